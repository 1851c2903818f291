"""The upstream model server: one pooled aiohttp client, its errors mapped to ours.

This is the only module that touches aiohttp's client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
from yarl import URL

from tracetap.proxy.http.errors import ProxyError, upstream_timeout, upstream_unreachable
from tracetap.proxy.upstream.lean_http import LeanPoster
from tracetap.proxy.upstream.stall import StallWatch

log = logging.getLogger("tracetap.upstream")


class UpstreamBroken(Exception):
    """The upstream failed after its reply had started (mid-body)."""


class Reply:
    """An upstream response whose body the caller reads: reading it to the end (or to a
    failure) closes it; a caller that stops before must close it."""

    def __init__(self, response: aiohttp.ClientResponse, stall_seconds: float | None = None):
        self._response = response
        self.stall_seconds = stall_seconds  # sock_read, watched per stream (proxy.upstream.stall)
        self.status = response.status
        self.headers = response.headers
        self.content_type = response.content_type
        self.on_close = None  # set by the pool to count in-flight calls per target
        self.closed = False  # a plain attribute: a caller's check costs no call

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise UpstreamBroken(_describe(exc)) from exc
        finally:
            self.close()

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """Bytes as they arrive; raises UpstreamBroken if the upstream dies mid-body (or
        sends nothing for ``stall_seconds``: watched a few times a timeout, not re-armed
        per read)."""
        watch = StallWatch(self._response, self.stall_seconds) if self.stall_seconds else None
        try:
            async for data in self._response.content.iter_any():
                yield data
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise UpstreamBroken(_describe(exc)) from exc
        finally:
            if watch is not None:
                watch.stop()
            self.close()

    def close(self) -> None:
        # release() would drain the body; close() drops the connection, which is what
        # a cancelled stream needs (the upstream stops generating).
        if self.closed:
            return
        self.closed = True
        self._response.close()
        if self.on_close is not None:
            self.on_close()
            self.on_close = None


class ConnectFailed(ProxyError):
    """Nothing reached the upstream (connection refused or no route): safe to retry."""


class UpstreamClient:
    """One pooled HTTP client shared by every upstream target."""

    def __init__(self, *, timeout: float, connect_timeout: float, max_connections: int,
                 api_key: str | None = None):
        self.timeout = timeout
        # Probes (health, flavor detection) authenticate like forwarded calls do.
        self._probe_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client_timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout, sock_read=timeout
        )
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._lean = LeanPoster(self._probe_headers)

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0,
                                         keepalive_timeout=60)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._client_timeout,
            auto_decompress=False,  # relay bytes as they are
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        )

    async def close(self) -> None:
        self._lean.close()
        if self._session is not None:
            await self._session.close()

    async def send(self, method: str, url: str, headers: dict[str, str], body) -> Reply:
        """Send a request; connection failures and timeouts become ProxyErrors. ``url`` is
        already encoded (``exposure.upstream_path``): sent as it is, not decoded, requoted
        or dot-resolved, so the upstream sees the path that was checked."""
        assert self._session is not None, "UpstreamClient.start() not called"
        try:
            response = await self._session.request(
                method, URL(url, encoded=True), headers=headers, data=body, allow_redirects=False,
            )
        except asyncio.TimeoutError as exc:
            raise upstream_timeout(self.timeout) from exc
        except aiohttp.ClientConnectorError as exc:
            error = upstream_unreachable(_describe(exc))
            raise ConnectFailed(error.status, error.message, error.type, error.code) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise upstream_unreachable(_describe(exc)) from exc
        return Reply(response, self.timeout)

    async def status(self, url: str, timeout: float = 2.0) -> int | None:
        """The HTTP status a small GET gets (health probes); None when nothing answers."""
        assert self._session is not None
        try:
            async with self._session.get(
                url, headers=self._probe_headers, timeout=aiohttp.ClientTimeout(total=timeout),
            ) as response:
                return response.status
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    async def get_json(self, url: str, timeout: float = 5.0):
        """Small GET for probes (health, flavor detection); None on any failure."""
        assert self._session is not None
        try:
            async with self._session.get(
                url, headers=self._probe_headers, timeout=aiohttp.ClientTimeout(total=timeout),
            ) as response:
                if response.status != 200:
                    return None
                return await response.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None


    async def post_json(self, url: str, body: dict, timeout: float = 10.0) -> tuple[int, Any]:
        """Small POST off the request path (tokenizer endpoints): (status, decoded JSON or
        None); status 0 when the upstream could not be reached or answered no JSON."""
        # msgspec, not the json module: a tokenize question carries the whole
        # conversation and its answer every prompt id (at 70k tokens, 0.9 → 0.14 ms to
        # encode and 4.6 → 1.9 ms to decode).
        status, raw = await self.post_raw(url, msgspec.json.encode(body), timeout)
        try:
            return status, msgspec.json.decode(raw) if raw and raw.strip() else None
        except msgspec.DecodeError:
            return status, None

    async def post_raw(self, url: str, body: bytes, timeout: float = 10.0,
                       ) -> tuple[int, bytes | None]:
        """``post_json`` with the JSON body and the answer as bytes, for a caller that
        reads only part of the answer; (0, None) when the upstream could not be reached.
        Asked over a kept-alive connection of its own where the answer is plain (a tenth of
        aiohttp's CPU), else through aiohttp (proxy.upstream.lean_http)."""
        assert self._session is not None
        answer = await self._lean.post(url, body, timeout)
        if answer is not None:
            return answer
        try:
            async with self._session.post(
                url, data=body, timeout=aiohttp.ClientTimeout(total=timeout),
                headers={**self._probe_headers, "Content-Type": "application/json"},
            ) as response:
                return response.status, await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return 0, None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


__all__ = ["ConnectFailed", "Reply", "UpstreamBroken", "UpstreamClient"]
