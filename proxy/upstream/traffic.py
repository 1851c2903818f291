"""The calls in flight to one upstream, and the questions tracetap asks it between them.

llama-cpp-python ends a streaming generation (``[DONE]`` after the tokens so far) as soon
as any other request reaches it (its ``--interrupt_requests``, on by default; even
``GET /v1/models`` counts). So tracetap's own requests to an upstream (tokenize, health,
flavor probes) go only through a window in which no model call to that upstream is in
flight, and calls that arrive while such a question is out wait for its answer. There is
no timeout after which a question is asked anyway: whoever asks either waits for a window
(``window``) or does not ask now (``try_window``).

Known only per process: with ``serve --workers N`` each worker sees its own calls.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class Traffic:
    """One upstream's calls in flight (counted from before the request is sent until the
    reply is closed) and the questions out to it. One owner: the pool's Target."""

    def __init__(self) -> None:
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._asking = 0
        self._answered = asyncio.Event()
        self._answered.set()

    @property
    def idle(self) -> bool:
        return self.inflight == 0 and not self._asking

    async def admit(self) -> None:
        """Count a call as in flight, once no question is out."""
        while self._asking:
            await self._answered.wait()
        self.inflight += 1  # no await since the check: no question starts in between
        self._idle.clear()

    def release(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    @contextlib.asynccontextmanager
    async def window(self) -> AsyncIterator[None]:
        """Wait (however long it takes) until no call is in flight, then hold new ones."""
        while self.inflight:
            await self._idle.wait()
        self._enter()  # no await since the check: no call is admitted in between
        try:
            yield
        finally:
            self._leave()

    @contextlib.asynccontextmanager
    async def try_window(self) -> AsyncIterator[bool]:
        """A window now if no call is in flight (yields True), else nothing (False)."""
        if self.inflight:
            yield False
            return
        self._enter()
        try:
            yield True
        finally:
            self._leave()

    def _enter(self) -> None:
        self._asking += 1
        self._answered.clear()

    def _leave(self) -> None:
        self._asking -= 1
        if not self._asking:
            self._answered.set()
