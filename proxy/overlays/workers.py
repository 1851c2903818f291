"""The proxy's side of a patch's worker process: start it, call hooks in it, end it.

One worker per installed patch, started on first use and again after it dies. Hooks are
sent one at a time (the worker runs them in order). A call the proxy stops waiting for
(the hook ran past ``--overlay-timeout``: the runner cancels it) kills the worker, since
it is still busy with the hook and its late answer must reach nobody; so does a frame
that is not one. Either way the hook's call fails (open or closed, as configured), the
worker is started again for the next one, and the episodes it served start their state
again (``on_episode_start`` runs again before their next hook).

Every worker of a process shares one ``Confinement``: the limits, the sandbox it starts in
(``overlays.bwrap``) and the cap on workers at once (``--overlay-patch-max-workers``, so
at most that many times ``--overlay-patch-memory`` in all). A worker holds its place from
its first start until it is killed for good (``kill``), restarts included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from typing import Any, NamedTuple

import msgspec

from tracetap.proxy.overlays import frames
from tracetap.proxy.overlays.bwrap import Launcher, SandboxUnavailable

log = logging.getLogger("tracetap.overlays")

STDERR_LINES = 50  # a worker's stderr lines logged, per worker (the rest is read, dropped)


class Limits(NamedTuple):
    memory_mb: int = 512
    cpu_seconds: int = 10  # per hook, a backstop behind the wall-time budget
    files: int = 32
    # Wall time to start the worker and import the patch. The worker's CPU limit while
    # loading is above it, so a loop at import ends here on every machine, however
    # loaded (one message, not a race between two limits).
    load_seconds: int = 10


class WorkerDied(Exception):
    """The worker exited, was killed, or wrote something that is not a frame."""


class WorkerRefused(Exception):
    """No worker is started: the sandbox cannot be set up here, or the cap is reached.
    Not the patch's fault; the message says what the operator can do."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # the admin API's error code


class Confinement:
    """What all the workers of one process share: limits, sandbox, and the cap."""

    def __init__(
        self, limits: Limits, launcher: Launcher | None = None, max_workers: int = 8
    ) -> None:
        self.limits = limits
        self.launcher = launcher or Launcher("bwrap")
        self.max_workers = max_workers
        self.running = 0  # workers holding a place (started, not killed for good)

    def take(self) -> None:
        if self.running >= self.max_workers:
            raise WorkerRefused(
                "overlay_capacity",
                f"{self.running} patch workers are running, each of up to "
                f"{self.limits.memory_mb} MiB (--overlay-patch-max-workers "
                f"{self.max_workers}: {self.max_workers * self.limits.memory_mb} MiB in all); "
                "delete a patch first (DELETE /tracetap/overlays/NAME)"
            )
        self.running += 1

    def give(self) -> None:
        self.running -= 1

    async def argv(self) -> list[str]:
        limits = self.limits
        args = [str(limits.memory_mb), str(limits.cpu_seconds), str(limits.files),
                str(limits.load_seconds), self.launcher.sandbox]
        try:
            return await self.launcher.argv(args)
        except SandboxUnavailable as exc:
            raise WorkerRefused(
                "overlay_sandbox_unavailable",
                f"runtime patches run only in a sandbox, and {exc}; or start the proxy "
                "with --overlay-patch-sandbox unsandboxed to run them without one "
                "(only for patches you trust: docs/overlays.md)"
            ) from exc


class Worker:
    """One patch's worker process (restarted as needed by ``call``)."""

    def __init__(self, name: str, source: str, confinement: Confinement) -> None:
        self.name = name
        self.source = source
        self.confinement = confinement
        self.limits = confinement.limits
        self._placed = False  # holds a place in the confinement's cap
        self.process: asyncio.subprocess.Process | None = None
        self.loaded: frames.Loaded | None = None
        self.generation = 0  # raised at every start: episodes started before start again
        self.started: set[str] = set()  # episodes whose on_episode_start ran in this one
        self.restarts = 0
        self._ids = 0
        self._lock = asyncio.Lock()
        self._stderr: asyncio.Task | None = None
        self._reapers: set[asyncio.Future] = set()  # waits of killed processes

    async def load(self) -> frames.Loaded:
        """Start the worker and load the patch; ValueError saying why it did not load,
        WorkerRefused when it could not be started at all."""
        async with self._lock:
            return await self._start()

    async def _start(self) -> frames.Loaded:
        if self.alive:
            assert self.loaded is not None
            return self.loaded
        if self.process is not None:
            self.restarts += 1
            log.warning(
                "overlay %s: its worker ended (status %s); starting it again",
                self.name,
                self.process.returncode,
            )
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "LANG")}
        self.loaded = None
        argv = await self.confinement.argv()
        if not self._placed:
            self.confinement.take()
            self._placed = True
        self.process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd="/",
            start_new_session=True,
        )
        self._stderr = asyncio.create_task(self._drain(self.process))
        self.generation += 1
        self.started = set()
        try:
            answer = await asyncio.wait_for(
                self._exchange(frames.Load(name=self.name, source=self.source)),
                self.limits.load_seconds,
            )
        except asyncio.TimeoutError as exc:
            self._kill_now()
            raise ValueError(f"loading it took longer than {self.limits.load_seconds} s") from exc
        except WorkerDied as exc:
            self._kill_now()
            raise ValueError(f"its worker died while loading it ({exc})") from exc
        except BaseException:  # cancelled mid-load: a half-started worker serves nobody
            self._kill_now()
            raise
        if not isinstance(answer, frames.Loaded):
            self._kill_now()
            why = answer.error if isinstance(answer, frames.Failed) else "a wrong answer"
            raise ValueError(why)
        self.loaded = answer
        return answer

    @property
    def alive(self) -> bool:
        return (
            self.process is not None and self.process.returncode is None and self.loaded is not None
        )

    async def call(self, call: frames.Call, start: frames.Call | None) -> frames.Answer:
        """One hook, after the episode's ``start`` (its ``on_episode_start``) when this
        worker has not run it yet: it is new, or was started again since. A ``call`` that
        is the start itself runs once. WorkerDied if the worker broke."""
        async with self._lock:
            try:
                await self._start()
            except (ValueError, WorkerRefused) as exc:  # it loaded once: now it does not
                raise WorkerDied(str(exc)) from exc
            try:
                if start is not None and call.episode not in self.started:
                    self.started.add(call.episode)  # a failed start is not run again here
                    started = await self._answer(start)
                    if started.kind == "error" and call.hook == "on_episode_start":
                        self.started.discard(call.episode)  # failed closed: asked again
                    if started.kind == "error" or call.hook == "on_episode_start":
                        return started
                elif call.hook == "on_episode_start":
                    return frames.Answer(id=0, kind="none")  # this worker ran it already
                return await self._answer(call)
            except asyncio.CancelledError:
                # The hook ran past its budget: the worker is still in it. Killed, so
                # its late answer reaches nobody; the next call starts a new one.
                self._kill_now()
                raise
            except WorkerDied:
                self._kill_now()
                raise

    async def _answer(self, call: frames.Call) -> frames.Answer:
        self._ids += 1
        call = msgspec.structs.replace(call, id=self._ids)
        answer = await self._exchange(call)
        if not isinstance(answer, frames.Answer) or answer.id != call.id:
            raise WorkerDied("it answered out of turn")
        return answer

    async def _exchange(self, message: Any) -> frames.FromWorker:
        process = self.process
        assert process is not None and process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(frames.frame(message))
            await process.stdin.drain()
            header = await process.stdout.readexactly(4)
            body = await process.stdout.readexactly(frames.length(header))
            return frames.from_worker(body)
        except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError) as exc:
            code = await _exit_code(process)
            raise WorkerDied(self._ended(code) if code is not None else str(exc)) from exc
        except (msgspec.MsgspecError, ValueError) as exc:  # garbage, a frame too long
            raise WorkerDied(f"not a frame: {exc}") from exc

    def _ended(self, code: int) -> str:
        if code in (-signal.SIGXCPU, 128 + signal.SIGXCPU):  # RLIMIT_CPU's (bwrap: 128+)
            return (f"it used more than {self.limits.cpu_seconds} s of CPU time "
                    "(--overlay-patch-cpu)")
        return f"exit status {code}"

    def _kill_now(self) -> None:
        """Kill the worker at once (from a cancelled call too); it is reaped meanwhile."""
        process = self.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        if process is not None:
            self._reapers.add(asyncio.ensure_future(process.wait()))

    async def kill(self) -> None:
        """Kill the worker and wait until it and its pipes are gone; its place is free."""
        self._kill_now()
        if self._placed:
            self._placed = False
            self.confinement.give()
        if self._reapers:
            await asyncio.gather(*self._reapers, return_exceptions=True)
            self._reapers.clear()
        if self._stderr is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._stderr  # ends at the pipe's end, now the process is gone

    async def _drain(self, process: asyncio.subprocess.Process) -> None:
        """The worker's stderr (a patch's prints, a traceback), logged up to a point."""
        assert process.stderr is not None
        logged = 0
        while line := await process.stderr.readline():
            if logged < STDERR_LINES:
                logged += 1
                log.info(
                    "overlay %s worker: %s",
                    self.name,
                    line.decode("utf-8", "replace").rstrip()[:500],
                )


async def _exit_code(process: asyncio.subprocess.Process) -> int | None:
    """The worker's status once it is gone (a moment, when its pipe just closed)."""
    try:
        return await asyncio.wait_for(process.wait(), 1.0)
    except asyncio.TimeoutError:
        process.kill()
        return None
