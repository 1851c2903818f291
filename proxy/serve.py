"""Running one proxy process: its listening sockets, the event loop, the collector."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket

from aiohttp import web

from tracetap.proxy.settings import Settings


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
    """Serve until SIGTERM or SIGINT, then drain (--drain-timeout) and flush."""
    _tune_gc()
    web.run_app(
        app,
        sock=sockets,
        print=None,
        shutdown_timeout=settings.drain_timeout,
        loop=_new_loop(),
        access_log=None,
    )


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
