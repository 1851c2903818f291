"""An upstream stream's stall timeout, checked a few times a timeout rather than per read.

aiohttp's ``sock_read`` timeout cancels and re-arms a loop timer at every read of the
socket: on a paced stream (one SSE event a read, an engine decoding at ~5 ms a token) that
is a tenth of the proxy's CPU per read. Once a streamed reply's headers are in,
``Reply.iter_chunks`` hands the timeout over to a ``StallWatch``: one timer that wakes
every ``seconds / SLICES`` and asks whether the reply's body grew since its last look.

The same rule as ``sock_read``: the upstream sent no byte for ``seconds`` while the proxy
was ready to read it (a reply whose reading the proxy paused, its client slow to take the
bytes, is not stalled: that is the client's doing, bounded by ``--call-deadline``). A stall
is seen at most ``seconds / SLICES`` late, and ends the read as aiohttp's would: the
reader's waiter gets aiohttp's ``SocketTimeoutError``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

SLICES = 8  # looks per timeout: a stall is seen within seconds * (1 + 1/SLICES)


class StallWatch:
    """``seconds`` of no upstream byte ends ``response``'s body read (None: no timeout)."""

    __slots__ = ("_content", "_handle", "_loop", "_protocol", "_seconds", "_seen", "_since")

    def __init__(self, response: aiohttp.ClientResponse, seconds: float) -> None:
        self._content = response.content
        connection = response.connection
        self._protocol: Any = connection.protocol if connection is not None else None
        self._seconds = seconds
        self._loop = asyncio.get_running_loop()
        self._seen = self._content.total_bytes
        self._since = self._loop.time()
        self._handle: asyncio.TimerHandle | None = None
        if self._protocol is None:
            return  # the body is all in (or the connection gone): nothing left to wait for
        # aiohttp's per-read timer is off for the rest of this reply (each request sets its
        # own again); the one armed for the last read is dropped at the next read.
        self._protocol.read_timeout = None
        self._handle = self._loop.call_later(seconds / SLICES, self._look)

    def _look(self) -> None:
        self._handle = None
        content, now = self._content, self._loop.time()
        if content.is_eof() or content.exception() is not None:
            return  # the upstream ended it, or something else did: nothing to watch
        if content.total_bytes != self._seen or self._paused():
            self._seen, self._since = content.total_bytes, now
        elif now - self._since >= self._seconds:
            content.set_exception(aiohttp.SocketTimeoutError(
                "Timeout on reading data from socket"))
            return
        self._handle = self._loop.call_later(self._seconds / SLICES, self._look)

    def _paused(self) -> bool:
        """Whether the proxy stopped reading the socket (its buffer is full): the time
        does not count, as aiohttp's timer stops while it is paused."""
        protocol = self._protocol
        return bool(getattr(protocol, "_reading_paused", False)
                    or getattr(protocol, "_buffer_paused", False))

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
