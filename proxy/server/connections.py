"""Client connections are bounded: one peer cannot take the descriptors every other needs.

An agent (or a thousand of them on one host) may open connections and leave them idle,
or send half a request and stall. Unbounded, they use up the process's open-files limit
and then every new client is reset. So: the soft open-files limit is raised to the hard
one at start; a connection that has not sent a whole request's headers within
``--idle-timeout`` seconds (after it opened, or after its last reply) is closed (aiohttp's
keep-alive timer, which runs from the connection's start since aiohttp 3.14.4: earlier
ones left a connection that never sent a request open for good; tests/test_hostile_edge.py
checks it); a stalled body is cut off by
``proxy.http.bodies``; and a peer (an IP address) past ``--max-peer-connections`` open
connections, or any peer once the process nears its descriptor limit, is answered a 429
or 503 in the OpenAI error shape and closed at once.
"""

from __future__ import annotations

import json
import logging
import resource
from collections import Counter
from collections.abc import Callable

from aiohttp import web

from tracetap.proxy.runtime.settings import Settings

log = logging.getLogger("tracetap")

# Descriptors kept for everything that is not a client connection: the database, journal,
# logs and listening sockets, plus upstream connections (--max-connections, at most half
# the limit: a call in flight needs one of each, an idle client connection none upstream).
RESERVED_FDS = 128


def raise_open_files_limit() -> tuple[int, int]:
    """Soft RLIMIT_NOFILE up to the hard limit; (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in (hard, 1 << 20, 10240):  # macOS reports an unlimited hard limit it refuses
        if target == resource.RLIM_INFINITY or target <= soft:
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            continue
        return soft, target
    return soft, soft


def runner(app: web.Application, settings: Settings, **kwargs) -> web.AppRunner:
    """The app's runner with the client-connection limits of ``settings``."""
    return web.AppRunner(app, access_log=None, keepalive_timeout=settings.idle_timeout,
                         **kwargs)


class PeerLimit:
    """Counts open client connections per peer address on one aiohttp server, and
    refuses those past the caps as soon as they are made (before a byte is read)."""

    def __init__(self, per_peer: int, total: int, on_refused: Callable[[str], None]):
        self.per_peer = per_peer  # 0: no per-peer cap
        self.total = total
        self._on_refused = on_refused
        self._open: Counter[str] = Counter()
        self._peer_of: dict[object, str] = {}

    def install(self, server: web.Server) -> None:
        """Wrap the server's connection bookkeeping, which every request handler
        (aiohttp's protocol) reports to when its connection is made and lost."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler, transport) -> None:
            made(handler, transport)
            self._made(handler, transport)

        def connection_lost(handler, exc=None) -> None:
            peer = self._peer_of.pop(handler, None)
            if peer is not None:
                self._open[peer] -= 1
                if not self._open[peer]:
                    del self._open[peer]
            lost(handler, exc)

        server.connection_made = connection_made
        server.connection_lost = connection_lost

    def _made(self, handler, transport) -> None:
        peername = transport.get_extra_info("peername")
        if not isinstance(peername, tuple):  # a Unix socket: the admin listener, not agents
            return
        peer = peername[0]
        if len(self._peer_of) >= self.total:
            self._refuse(transport, 503, "service_unavailable", "the proxy has as many "
                         "connections open as it has descriptors for; try again shortly")
        elif self.per_peer and self._open[peer] >= self.per_peer:
            self._refuse(transport, 429, "too_many_connections", f"{peer} has "
                         f"{self._open[peer]} connections open to this proxy, its limit "
                         "(--max-peer-connections); reuse them or close some")
        else:
            self._open[peer] += 1
            self._peer_of[handler] = peer

    def _refuse(self, transport, status: int, code: str, message: str) -> None:
        self._on_refused(code)
        body = json.dumps({"error": {"message": message, "type": "rate_limit_error"
                                     if status == 429 else "server_error", "code": code}})
        reason = "Too Many Requests" if status == 429 else "Service Unavailable"
        transport.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
            f"{body}".encode())
        transport.close()


def limit_peers(runner: web.AppRunner, settings: Settings,
                on_refused: Callable[[str], None]) -> PeerLimit:
    """Install the connection caps on a set-up runner's server."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 30
    total = max(64, soft - RESERVED_FDS - min(settings.max_connections, soft // 2))
    limit = PeerLimit(settings.max_peer_connections, total, on_refused)
    assert runner.server is not None, "runner.setup() first"
    limit.install(runner.server)
    return limit
