"""The admission gate: pause for a weight sync, calls in flight."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tracetap.proxy.http.errors import ProxyError


class Gate:
    """While paused, new model calls wait (at most ``pause_timeout`` seconds, then 503);
    calls in flight finish. One per process: ``proxy.policy.controls`` opens and closes it for
    every process on the database."""

    def __init__(self, pause_timeout: float):
        self.pause_timeout = pause_timeout
        self._running = asyncio.Event()
        self._running.set()
        # A plain attribute, kept with _running: every streamed token reads it
        # (proxy.policy.versions), and an attribute costs no call.
        self.paused = False
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        # Calls that a pause in abort mode may cut (proxy.call.continuation registers them).
        self.cuts: set[Callable[[], None]] = set()

    @property
    def idle(self) -> bool:
        return self._idle.is_set()

    def close(self) -> None:
        self._running.clear()
        self.paused = True

    def open(self) -> None:
        self._running.set()
        self.paused = False

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
        self.inflight += 1
        self._idle.clear()

    def cut_all(self) -> None:
        """A pause in abort mode: every registered call is cut at the engine now."""
        for cut in list(self.cuts):
            cut()

    async def hold(self) -> bool:
        """A call cut for a weight sync steps out of the in-flight count (the sync need not
        wait for it) until the gate opens, then steps back in. False: the pause outlasted
        ``pause_timeout``."""
        self.release()
        try:
            await asyncio.wait_for(self._running.wait(), self.pause_timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self.inflight += 1
            self._idle.clear()

    def release(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()
