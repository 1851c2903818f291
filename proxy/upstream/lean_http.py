"""Small JSON POSTs to an engine over kept-alive HTTP/1.1 connections, without aiohttp.

The writer asks an engine's tokenizer twice a call when it returns no ids (the prompt, the
completion: proxy.tokens.resolve). Through aiohttp's client each such question cost
~120 µs of CPU beside what it carries (its request and response objects, headers, timers,
payload writers); here a question is one write of the request's bytes and a parse of the
answer's head. Only the plain case is handled: ``http://`` with no credentials in the URL,
an answer framed by ``Content-Length``. Anything else (TLS, a chunked or unframed answer,
a connection that fails or closes before its answer, more bytes than the answer) answers
``None``, and the caller asks through aiohttp instead: these questions only read, so
asking again is safe. A timeout answers ``(0, None)``, as the caller's aiohttp path does.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

MAX_HEAD = 64 << 10  # an answer's head longer than this is not a tokenizer's
IDLE_PER_ORIGIN = 8  # connections kept for the next questions; more are closed
MAX_URLS = 256  # URLs whose reading is kept


class _Unsupported(Exception):
    """The answer is not one this client reads: the caller asks through aiohttp."""


class _Unframed(_Unsupported):
    """The engine frames its answers otherwise (chunked, to the close, HTTP/2): every
    question to it goes through aiohttp from now on, rather than being asked twice."""


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: one question at a time, its answer read whole."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future | None = None
        self.body_at = -1  # where the body starts in ``buffer``, once the head is read
        self.length = 0
        self.status = 0
        self.reusable = True
        self.lost = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.waiter is None or self.waiter.done():
            self.reusable = False  # bytes nobody asked for: never reuse
            return
        try:
            if self.body_at < 0:
                self._head()
            if self.body_at >= 0 and len(self.buffer) >= self.body_at + self.length:
                if len(self.buffer) > self.body_at + self.length:
                    raise _Unsupported("more bytes than the answer")
                body = bytes(memoryview(self.buffer)[self.body_at:])
                self.waiter.set_result((self.status, body))
        except _Unsupported as exc:
            self.waiter.set_exception(exc)
        except ValueError as exc:
            self.waiter.set_exception(_Unsupported(str(exc)))

    def _head(self) -> None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEAD:
                raise _Unsupported("head too long")
            return
        lines = bytes(self.buffer[:end]).split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        if version not in (b"HTTP/1.1", b"HTTP/1.0"):
            raise _Unframed("not HTTP/1.x")
        self.status = int(rest[:3])
        if self.status < 200:
            raise _Unframed("an interim answer")
        self.reusable = version == b"HTTP/1.1"
        length = None
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                if length is not None or not value.strip().isdigit():
                    raise _Unsupported("Content-Length")
                length = int(value)
            elif name == b"transfer-encoding":
                raise _Unframed("Transfer-Encoding")
            elif name == b"connection" and b"close" in value.lower():
                self.reusable = False
        if length is None:
            raise _Unframed("no Content-Length")
        self.length, self.body_at = length, end + 4

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(_Unsupported("connection closed"))

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()


class LeanPoster:
    """Kept-alive connections per origin; ``post`` answers ``(status, body)``, or None
    where the caller must ask through aiohttp."""

    def __init__(self, headers: dict[str, str]):
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode()
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._unframed: set[tuple[str, int]] = set()  # engines asked through aiohttp only
        # Each URL read once (a few per engine: its tokenize endpoints), not per question.
        self._targets: dict[str, tuple[tuple[str, int], str, str] | None] = {}
        self._closed = False

    async def post(self, url: str, body: bytes, timeout: float,
                   ) -> tuple[int, bytes | None] | None:
        target = self._targets.get(url, False)
        if target is False:
            if len(self._targets) >= MAX_URLS:
                self._targets.clear()
            target = self._targets[url] = _target(url)
        if target is None or target[0] in self._unframed:
            return None
        key, path, netloc = target
        head = (f"POST {path} HTTP/1.1\r\nHost: {netloc}\r\nAccept: */*\r\n"  # as aiohttp
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n").encode()
        loop = asyncio.get_running_loop()
        conn = self._take(key)
        if conn is None:
            try:
                _, conn = await asyncio.wait_for(
                    loop.create_connection(_Connection, *key), timeout)
            except (OSError, asyncio.TimeoutError):
                return None  # aiohttp's path says how it failed
        conn.waiter = waiter = loop.create_future()
        try:
            conn.transport.write(b"".join((head, self._headers, b"\r\n", body)))
        except (OSError, RuntimeError):  # closed under us
            conn.close()
            return None
        timer = loop.call_later(timeout, _expire, waiter)
        try:
            status, answer = await waiter
        except _Unsupported as exc:
            conn.close()
            if isinstance(exc, _Unframed):
                self._unframed.add(key)
            return None
        except asyncio.TimeoutError:
            conn.close()
            return 0, None
        except asyncio.CancelledError:
            conn.close()  # its answer may still come: never handed to another question
            raise
        finally:
            timer.cancel()
        self._keep(key, conn)
        return status, answer

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.lost and conn.reusable and not conn.buffer:
                return conn
            conn.close()
        return None

    def _keep(self, key: tuple[str, int], conn: _Connection) -> None:
        idle = self._idle.setdefault(key, [])
        if self._closed or conn.lost or not conn.reusable or len(idle) >= IDLE_PER_ORIGIN:
            conn.close()
            return
        conn.buffer.clear()
        conn.waiter, conn.body_at = None, -1
        idle.append(conn)

    def close(self) -> None:
        self._closed = True  # a question still out closes its connection when answered
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


def _target(url: str) -> tuple[tuple[str, int], str, str] | None:
    """((host, port), path and query, netloc) of a plain ``http://`` URL, else None."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.username or parts.password or not parts.hostname:
        return None
    try:
        port = parts.port or 80
    except ValueError:
        return None
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return (parts.hostname, port), path, parts.netloc


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(asyncio.TimeoutError())
