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


class Exited(msgspec.Struct, frozen=True):
    code: int | None  # None when it was killed at the time limit
    timed_out: bool = False
    stdout: bytes = b""


async def run(
    argv: list[str],
    *,
    env: Mapping[str, str],
    timeout: float | None,
    log: Path | None = None,
    capture: bool = False,
) -> Exited:
    """Run ``argv``; stdout is captured (``capture``), else it and stderr go to ``log``
    (appended) or nowhere. Stdin is empty: a harness never waits on the terminal."""
    with _output(log) as out:
        process = await asyncio.create_subprocess_exec(
            *argv,
            env=dict(env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE if capture else out,
            stderr=out,
            start_new_session=True,
        )  # its own group: Ctrl-C is ours to pass on
        try:
            stdout, _ = await asyncio.wait_for(process.communicate(), timeout)
        except asyncio.TimeoutError:
            await _kill(process)
            return Exited(None, timed_out=True)
        except BaseException:  # interrupted: take the harness down with us
            await asyncio.shield(_kill(process))
            raise
    return Exited(process.returncode, stdout=stdout or b"")


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
