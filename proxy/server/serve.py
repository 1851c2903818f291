"""Running one proxy process: its listening sockets, the event loop, the collector."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import socket

from aiohttp import web

from tracetap.proxy.runtime.keys import STATE
from tracetap.proxy.runtime.settings import Settings
from tracetap.proxy.server import connections, heap

log = logging.getLogger("tracetap")


def listeners(
    settings: Settings, *, reuse_port: bool = False, admin_socket: bool = True
) -> tuple[list[socket.socket], str]:
    """The sockets to serve (agent port, then the admin listener if any), bound before
    anything is announced, and where the admin API is."""
    sockets = [listen_tcp(settings.host, settings.port, reuse_port)]
    admin_at = "the same port"
    if settings.admin_port is not None:
        sockets.append(listen_tcp(settings.host, settings.admin_port, reuse_port))
        admin_at = f"http://{settings.host}:{settings.admin_port}"
    if settings.admin_socket is not None:
        if admin_socket:
            sockets.append(listen_unix(settings.admin_socket))
        admin_at = f"unix:{settings.admin_socket}"
    return sockets, admin_at


def listen_tcp(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    try:
        return socket.create_server((host, port), backlog=1024, reuse_port=reuse_port)
    except OSError as exc:
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def listen_unix(path: str) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a socket file left by an earlier run
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # owner only: the socket is the admin credential's door
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(128)
    return sock


def run(app: web.Application, sockets: list[socket.socket], settings: Settings) -> None:
    """Serve until SIGTERM or SIGINT, then drain (--drain-timeout) and flush. What
    aiohttp's run_app does, with the runner's server in reach for the connection caps."""
    _tune_gc()
    heap.keep_freed_memory()
    before, after = connections.raise_open_files_limit()
    if after != before:
        log.info("open files limit raised from %d to %d", before, after)
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    main = loop.create_task(_serve(app, sockets, settings))
    try:
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        try:
            if not main.done():
                main.cancel()  # its finally drains and cleans up
                with contextlib.suppress(asyncio.CancelledError):
                    loop.run_until_complete(main)
        finally:
            _cancel_all(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()


async def _serve(app: web.Application, sockets: list[socket.socket], settings: Settings):
    runner = connections.runner(app, settings, handle_signals=True,
                                shutdown_timeout=settings.drain_timeout)
    await runner.setup()
    try:
        serve_connections(runner, settings)
        for sock in sockets:
            await web.SockSite(runner, sock).start()
        await asyncio.Event().wait()  # until SIGTERM or SIGINT raises GracefulExit
    finally:
        await runner.cleanup()


def serve_connections(runner: web.AppRunner, settings: Settings) -> connections.PeerLimit:
    """The per-peer and total connection caps on a set-up runner, refusals counted."""
    metrics = runner.app[STATE].metrics
    return connections.limit_peers(
        runner, settings, lambda reason: metrics.child(metrics.refused, reason).inc())


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


def _tune_gc() -> None:
    """A call allocates thousands of short-lived containers (decoded logprob entries,
    aiohttp's header maps) that reference counting frees. At the default threshold the
    cyclic collector ran every few requests, mostly walking live request objects: 6-8%
    of the CPU at c=32, with 50 ms full collections over the startup heap. Startup
    objects are frozen out of the collector, and it runs after 50,000 net allocations."""
    gc.freeze()
    gc.set_threshold(50_000)


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def announcement(settings: Settings, admin_at: str, token_note: str) -> str:
    """The one line `tracetap serve` prints once it listens (one process or a supervisor)."""
    from tracetap import __version__
    from tracetap.storage.engine import redact_url

    upstreams = ", ".join(spec.shown for spec in settings.upstreams)
    journal = f"journal {settings.journal_dir}"
    if settings.workers > 1:
        journal = (f"{settings.workers} workers, journals {settings.journal_dir}, "
                   f"{settings.worker_journal(1).name}, ...")
    return (f"tracetap {__version__} listening on http://{settings.host}:{settings.port} "
            f"-> upstream {upstreams}; storing in {redact_url(settings.database_url)} "
            f"({journal}); admin API on {admin_at}, {token_note}")
