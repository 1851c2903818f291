"""Client connections are bounded: one peer cannot take the descriptors every other needs.

An agent (or a thousand of them on one host) may open connections and leave them idle,
or send half a request and stall. Unbounded, they use up the process's open-files limit
and then every new client is reset. So: the soft open-files limit is raised to the hard
one at start; a connection that has not sent a whole request's headers within
``--idle-timeout`` seconds (after it opened, or after its last reply) is closed (aiohttp's
keep-alive timer, which runs from the connection's start since aiohttp 3.14.4: earlier
ones left a connection that never sent a request open for good; tests/test_hostile_edge.py
checks it); a stalled body is cut off by
``proxy.http.bodies``; and a peer (an IP address) holds at most ``--max-peer-connections``
open connections, and all peers together what the descriptor limit leaves. At a cap, a
new connection first takes the place of the longest idle one (of that peer; at the
descriptor limit, of the peer holding most): an idle connection costs its client only a
reconnect, while refusing the new one would refuse whoever shares the address (agents in
sandboxes on one host, or behind one NAT) because of one of them. Only when none is idle
is the new connection answered a 429 or 503 in the OpenAI error shape and closed at once.
"""

from __future__ import annotations

import json
import logging
import resource
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
    """Counts open client connections per peer address on one aiohttp server, and keeps
    them within the caps as soon as one is made (before a byte is read)."""

    def __init__(self, per_peer: int, total: int, on_refused: Callable[[str], None]):
        self.per_peer = per_peer  # 0: no per-peer cap
        self.total = total
        self._on_refused = on_refused
        # Each peer's open connections (aiohttp's request handlers), oldest first.
        self._open: dict[str, dict[object, None]] = {}
        self._peer_of: dict[object, str] = {}

    def install(self, server: web.Server) -> None:
        """Wrap the server's connection bookkeeping, which every request handler
        (aiohttp's protocol) reports to when its connection is made and lost."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler, transport) -> None:
            made(handler, transport)
            self._made(handler, transport)

        def connection_lost(handler, exc=None) -> None:
            self._forget(handler)
            lost(handler, exc)

        server.connection_made = connection_made
        server.connection_lost = connection_lost

    def _forget(self, handler) -> None:
        peer = self._peer_of.pop(handler, None)
        if peer is not None:
            handlers = self._open[peer]
            del handlers[handler]
            if not handlers:
                del self._open[peer]

    def _made(self, handler, transport) -> None:
        peername = transport.get_extra_info("peername")
        if not isinstance(peername, tuple):  # a Unix socket: the admin listener, not agents
            return
        peer = peername[0]
        if len(self._peer_of) >= self.total and not self._evict(
                max(self._open, key=lambda p: len(self._open[p]))):
            self._refuse(transport, 503, "service_unavailable", "the proxy has as many "
                         "connections open as it has descriptors for; try again shortly")
        elif (self.per_peer and len(self._open.get(peer, ())) >= self.per_peer
              and not self._evict(peer)):
            self._refuse(transport, 429, "too_many_connections", f"{peer} has "
                         f"{self.per_peer} connections open to this proxy, all busy, its "
                         "limit (--max-peer-connections); reuse them or close some")
        else:
            self._open.setdefault(peer, {})[handler] = None
            self._peer_of[handler] = peer

    def _evict(self, peer: str) -> bool:
        """Close ``peer``'s longest idle connection; False when none is idle."""
        idle = [h for h in self._open.get(peer, ()) if _idle(h)]
        if not idle:
            return False
        handler = min(idle, key=_idle_since)
        self._forget(handler)  # counted out now: its connection_lost comes later
        handler.force_close()
        self._on_refused("idle_connection_closed")
        return True

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


# aiohttp's request handler keeps no public "idle" flag. Waiting for a request's headers
# (none yet, or some: a slow sender is as idle) it awaits ``_waiter``; its keep-alive
# deadline, ``_next_keepalive_close_time``, is set at connect and after each reply, so
# the smallest is the longest idle (aiohttp >= 3.14.4, as pinned).
def _idle(handler) -> bool:
    waiter = getattr(handler, "_waiter", None)
    return (waiter is not None and not waiter.done()
            and not getattr(handler, "_request_in_progress", True))


def _idle_since(handler) -> float:
    return getattr(handler, "_next_keepalive_close_time", 0.0)


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
