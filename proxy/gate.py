"""The admission gate: pause for a weight sync, quiet windows, calls in flight."""

from __future__ import annotations

import asyncio
import contextlib

from tracetap.proxy.errors import ProxyError


class Gate:
    """While paused, new model calls wait (at most ``pause_timeout`` seconds, then 503);
    calls in flight finish. One per process: ``proxy.controls`` opens and closes it for
    every process on the database."""

    def __init__(self, pause_timeout: float):
        self.pause_timeout = pause_timeout
        self._running = asyncio.Event()
        self._running.set()
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        # Questions to an engine that cuts streams when asked anything (llama-cpp-python):
        # while one is out, new model calls wait for its answer.
        self._asking = 0
        self._not_asking = asyncio.Event()
        self._not_asking.set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    @property
    def idle(self) -> bool:
        return self._idle.is_set()

    def close(self) -> None:
        self._running.clear()

    def open(self) -> None:
        self._running.set()

    async def drained(self) -> None:
        """Returns once no model call is in flight."""
        await self._idle.wait()

    async def admit(self) -> None:
        """Wait while paused (bounded), then count the call as in flight."""
        if not self._running.is_set():
            try:
                await asyncio.wait_for(self._running.wait(), self.pause_timeout)
            except asyncio.TimeoutError:
                raise ProxyError(
                    503,
                    "the proxy is paused for a weight update; retry shortly",
                    "server_error",
                    "paused",
                    headers={"Retry-After": "5"},
                ) from None
        while self._asking:
            await self._not_asking.wait()
        self.inflight += 1  # no await since the check: no question can start in between
        self._idle.clear()

    def release(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    @contextlib.asynccontextmanager
    async def quiet(self):
        """A window with no model call in flight; calls that arrive meanwhile wait."""
        while not self._idle.is_set():
            await self._idle.wait()
        self._asking += 1  # no await since the check: no call can be admitted in between
        self._not_asking.clear()
        try:
            yield
        finally:
            self._asking -= 1
            if not self._asking:
                self._not_asking.set()
