"""One command run in a process group of its own, with a time limit: on the limit, or
when the run is interrupted, the whole group is killed (a harness's children too)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Mapping
from pathlib import Path

import msgspec

GRACE = 2.0  # seconds between SIGTERM and SIGKILL
STDERR_GRACE = 1.0  # seconds its stderr is read after it exits
TAIL = 2000  # characters of a command's stderr kept (its end: where it says why it failed)


class Exited(msgspec.Struct, frozen=True):
    code: int | None  # None when it was killed at the time limit
    timed_out: bool = False
    stdout: bytes = b""
    stderr_tail: str = ""  # the last TAIL characters of its stderr (all of it is in log)


async def run(
    argv: list[str],
    *,
    env: Mapping[str, str],
    timeout: float | None,
    log: Path | None = None,
    capture: bool = False,
) -> Exited:
    """Run ``argv``; stdout is captured (``capture``), else it goes to ``log`` (appended)
    or nowhere; stderr goes to ``log`` too, and its tail is kept. Stdin is empty: a
    harness never waits on the terminal."""
    tail = bytearray()
    with _output(log) as out:
        process = await asyncio.create_subprocess_exec(
            *argv,
            env=dict(env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE if capture else out,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )  # its own group: Ctrl-C is ours to pass on
        try:
            stdout = await asyncio.wait_for(_finish(process, out, tail), timeout)
        except asyncio.TimeoutError:
            await _kill(process)
            return Exited(None, timed_out=True, stderr_tail=_text(tail))
        except BaseException:  # interrupted: take the harness down with us
            await asyncio.shield(_kill(process))
            raise
    return Exited(process.returncode, stdout=stdout, stderr_tail=_text(tail))


async def _finish(process: asyncio.subprocess.Process, out, tail: bytearray) -> bytes:
    """Its stdout (captured) once it exits; its stderr copied meanwhile. A child it left
    running may hold stderr open: read for STDERR_GRACE seconds after the exit, no more."""
    errors = asyncio.ensure_future(_stderr(process, out, tail))
    try:
        stdout = b"" if process.stdout is None else await process.stdout.read()
        await process.wait()
        await asyncio.wait_for(asyncio.shield(errors), STDERR_GRACE)
    except asyncio.TimeoutError:
        pass
    finally:
        errors.cancel()
    return stdout


async def _stderr(process: asyncio.subprocess.Process, out, tail: bytearray) -> None:
    """Copy the command's stderr into the log as it comes, keeping its last bytes."""
    stream = process.stderr
    assert stream is not None
    while chunk := await stream.read(65536):
        if out is not asyncio.subprocess.DEVNULL:
            out.write(chunk)
            out.flush()
        tail += chunk
        del tail[: max(0, len(tail) - 4 * TAIL)]


def _text(tail: bytearray) -> str:
    return bytes(tail).decode("utf-8", "replace").strip()[-TAIL:]


async def _kill(process: asyncio.subprocess.Process) -> None:
    _signal(process.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), GRACE)
    except asyncio.TimeoutError:
        pass
    # Whether or not the leader obeyed: its children may outlive it in the group.
    _signal(process.pid, signal.SIGKILL)
    await process.wait()


def _signal(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:  # the group is already gone
        pass


class _output:
    """The file a command's output goes to, opened for as long as it runs."""

    def __init__(self, path: Path | None):
        self.path = path
        self.file = None

    def __enter__(self):
        if self.path is None:
            return asyncio.subprocess.DEVNULL
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "ab")  # closed in __exit__
        return self.file

    def __exit__(self, *exc_info) -> None:
        if self.file is not None:
            self.file.close()
