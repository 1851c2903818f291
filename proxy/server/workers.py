"""``serve --workers N``: a supervisor and N worker processes on one port (SO_REUSEPORT).

Each worker is a whole proxy (its own event loop, upstream pool, writer) with its own
journal (``Settings.worker_journal``); the kernel spreads connections over them. The
supervisor only starts, watches and stops them: a worker that dies is started again
under the same index, so it replays its own journal; SIGTERM or SIGINT stops every
worker the way SIGTERM stops one process (in-flight calls finish, journals are flushed).
Pause and the policy version reach every worker through the database (proxy.policy.controls);
/metrics reads every worker's values (prometheus_client's multiprocess mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import re
import shutil
import signal
import socket
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path

from tracetap.proxy.runtime.settings import Settings, Worker
from tracetap.proxy.server.parent_death import notify_on_parent_death

log = logging.getLogger("tracetap")

# A worker that dies this soon after it started, this many times in a row, is not going
# to start: the supervisor stops rather than restart it forever.
QUICK_EXIT_SECONDS = 10.0
QUICK_EXITS = 5
ORPHAN_CHECK_SECONDS = 1.0


def supervise(settings: Settings, log_level: str, token_note: str) -> int:
    from tracetap.proxy.server.serve import announcement, listeners

    if not hasattr(socket, "SO_REUSEPORT"):
        raise ValueError(
            "--workers above 1 needs SO_REUSEPORT, which this platform lacks: "
            "run one tracetap per port behind a load balancer instead"
        )
    # Bound (without SO_REUSEPORT) and closed again: a port in use fails here, with its
    # number, before anything is announced or started.
    for probe in listeners(settings, admin_socket=False)[0]:
        probe.close()
    metrics_dir = _fresh_metrics_dir(settings)
    _adopt_orphan_journals(settings)
    supervisor = Supervisor(settings, log_level, str(metrics_dir))
    with supervisor.signals():
        if not supervisor.start_all():
            return 1
        print(announcement(settings, _admin_at(settings), token_note), flush=True)
        return supervisor.watch()


def _admin_at(settings: Settings) -> str:
    if settings.admin_socket is not None:
        return f"unix:{settings.admin_socket} (worker 0)"
    if settings.admin_port is not None:
        return f"http://{settings.host}:{settings.admin_port}"
    return "the same port"


def _fresh_metrics_dir(settings: Settings) -> Path:
    """prometheus_client's multiprocess directory: emptied at every start (its files are
    per process id, and ids from an earlier run would be summed in), and named to every
    worker through the variable prometheus_client reads when it is imported."""
    path = Path(settings.data_dir).resolve() / "metrics"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    return path


def _adopt_orphan_journals(settings: Settings) -> None:
    """Journals of workers this run does not have (fewer --workers than last time) are
    moved into worker 0's, which replays them."""
    from tracetap.storage.journal import adopt

    for path in Path(settings.data_dir).glob("journal-*"):
        match = re.fullmatch(r"journal-(\d+)", path.name)
        if match and int(match.group(1)) >= settings.workers and path.is_dir():
            moved = adopt(path, settings.worker_journal(0))
            path.rmdir()
            if moved:
                log.info(
                    "%d journal segments of a worker this run does not have moved from %s to %s",
                    moved,
                    path,
                    settings.worker_journal(0),
                )


class Supervisor:
    def __init__(self, settings: Settings, log_level: str, metrics_dir: str):
        self.settings = settings
        self.log_level = log_level
        self.metrics_dir = metrics_dir
        self.context = multiprocessing.get_context("spawn")  # a clean interpreter each
        self.processes: dict[int, multiprocessing.process.BaseProcess] = {}
        self.started: dict[int, float] = {}
        self.quick_exits: dict[int, int] = {}
        self.announcing: dict[Connection, int] = {}  # workers not serving yet
        self.stopping = False
        self._wakeup_r, self._wakeup_w = socket.socketpair()

    @contextlib.contextmanager
    def signals(self):
        """SIGTERM and SIGINT mark the supervisor stopping and wake its wait."""
        self._wakeup_w.setblocking(False)
        previous = signal.set_wakeup_fd(self._wakeup_w.fileno())

        def stop(signum, frame):
            self.stopping = True

        handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            signal.set_wakeup_fd(previous)

    def start(self, index: int) -> None:
        ready_r, ready_w = self.context.Pipe(duplex=False)
        worker = Worker(index=index, count=self.settings.workers, metrics_dir=self.metrics_dir)
        process = self.context.Process(
            target=run_worker,
            name=f"tracetap-worker-{index}",
            args=(self.settings, worker, self.log_level, ready_w),
        )
        process.start()
        ready_w.close()
        self.processes[index] = process
        self.started[index] = time.monotonic()
        self.announcing[ready_r] = index

    def _heard(self, ready: Connection) -> bool:
        """A starting worker's pipe spoke: True when it serves, False when it died first."""
        del self.announcing[ready]
        try:
            ready.recv()
            return True
        except EOFError:
            return False
        finally:
            ready.close()

    def start_all(self) -> bool:
        """Start every worker and wait until each serves; False if one could not."""
        for index in range(self.settings.workers):
            self.start(index)
        failed = False
        while self.announcing and not self.stopping:
            sentinels = {p.sentinel for p in self.processes.values()}
            for ready in wait([*self.announcing, *sentinels, self._wakeup_r]):
                if ready is self._wakeup_r:
                    self._drain_wakeup()
                elif ready in sentinels or not self._heard(ready):
                    failed = self.stopping = True
        if failed:
            log.error("a worker could not start; stopping the others")
        if self.stopping:
            self.stop_all()
        return not self.stopping

    def watch(self) -> int:
        """Restart workers that die until told to stop; then stop them all."""
        while not self.stopping:
            sentinels = {p.sentinel: i for i, p in self.processes.items()}
            for ready in wait([*self.announcing, *sentinels, self._wakeup_r]):
                if ready is self._wakeup_r:
                    self._drain_wakeup()
                elif ready in self.announcing:
                    index = self.announcing[ready]
                    if self._heard(ready):
                        log.info("worker %d serves again", index)
                elif not self.stopping and not self._restart(sentinels[ready]):
                    self.stopping = True
        return self.stop_all()

    def _restart(self, index: int) -> bool:
        process = self.processes[index]
        process.join()
        _forget_metrics_of(process.pid, self.metrics_dir)
        lived = time.monotonic() - self.started[index]
        self.quick_exits[index] = (
            self.quick_exits.get(index, 0) + 1 if (lived < QUICK_EXIT_SECONDS) else 0
        )
        if self.quick_exits[index] >= QUICK_EXITS:
            log.error(
                "worker %d exited %d times within %.0f s of starting; stopping",
                index,
                QUICK_EXITS,
                QUICK_EXIT_SECONDS,
            )
            return False
        log.warning(
            "worker %d (pid %d) exited with code %s after %.1f s; starting it again "
            "(it replays its journal)",
            index,
            process.pid,
            process.exitcode,
            lived,
        )
        self.start(index)
        return True

    def stop_all(self) -> int:
        """SIGTERM to every worker, then wait for each to drain; 0 when all exited 0."""
        for process in self.processes.values():
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.drain_timeout + 30  # + flushing
        code = 0
        for index, process in self.processes.items():
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                log.error("worker %d did not stop in time; killed", index)
                process.kill()
                process.join()
            if process.exitcode != 0:
                code = 1
        for ready in list(self.announcing):
            ready.close()
        self.announcing.clear()
        self._wakeup_r.close()
        self._wakeup_w.close()
        return code

    def _drain_wakeup(self) -> None:
        with contextlib.suppress(BlockingIOError):
            self._wakeup_r.setblocking(False)
            self._wakeup_r.recv(4096)


def _forget_metrics_of(pid: int | None, metrics_dir: str) -> None:
    """A dead worker's gauges leave the live aggregates; its counters stay in the sums."""
    from prometheus_client import multiprocess

    if pid is not None:
        multiprocess.mark_process_dead(pid, metrics_dir)


def run_worker(settings: Settings, worker: Worker, log_level: str, ready: Connection) -> None:
    """One worker process: the whole proxy on the shared port, until SIGTERM."""
    os.setsid()  # a terminal's Ctrl-C reaches the supervisor only; it stops the workers
    logging.basicConfig(
        level=log_level.upper(),
        format=(f"%(asctime)s %(levelname)s %(name)s[worker {worker.index}]: %(message)s"),
    )
    logging.getLogger("alembic").setLevel(logging.WARNING)
    from tracetap.proxy.server import serve
    from tracetap.proxy.server.app import build_app

    app = build_app(settings, worker)
    supervisor = os.getppid()

    async def announce(_app) -> None:
        ready.send(os.getpid())
        ready.close()

    async def follow_supervisor(_app):
        task = asyncio.create_task(_stop_when_orphaned(supervisor))
        yield
        task.cancel()

    app.on_startup.append(announce)
    app.cleanup_ctx.append(follow_supervisor)
    # The admin socket is a file one process can serve: worker 0's (the admin API reaches
    # every worker through the database, so any one will do).
    sockets, _ = serve.listeners(settings, reuse_port=True, admin_socket=worker.index == 0)
    serve.run(app, sockets, settings)


async def _stop_when_orphaned(supervisor: int) -> None:
    """A supervisor killed outright cannot stop its workers: they stop themselves. On
    Linux the kernel signals the worker (SIGHUP, handled here: a graceful stop); the
    check below then only covers a supervisor gone before it asked. Elsewhere the worker
    asks every ORPHAN_CHECK_SECONDS."""
    loop = asyncio.get_running_loop()
    gone = asyncio.Event()
    loop.add_signal_handler(signal.SIGHUP, gone.set)
    try:
        if notify_on_parent_death(signal.SIGHUP):
            if os.getppid() == supervisor:
                await gone.wait()
        else:
            while os.getppid() == supervisor and not gone.is_set():
                await asyncio.sleep(ORPHAN_CHECK_SECONDS)
    finally:  # stopping anyway (or cancelled at cleanup): a later death is no signal
        notify_on_parent_death(0)
        loop.remove_signal_handler(signal.SIGHUP)
    log.warning("the supervisor (pid %d) is gone; stopping", supervisor)
    os.kill(os.getpid(), signal.SIGTERM)
