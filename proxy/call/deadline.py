"""A call's deadline: however a call is stuck, it ends within ``--call-deadline`` seconds.

A stream whose client never reads holds its call in flight for as long as the client
keeps the connection: the relay waits to write, the upstream waits to be read. A pause in
abort mode cuts such a stream only when it can be continued exactly
(proxy.call.continuation); one that cannot (a request with ``tools``) would hold the pause,
and every other call behind it, for good. The deadline bounds that and every other wait
of a call: past it the call is ended (the upstream reply closed, so the engine aborts it;
a stream already begun is cut, a reply not begun is a 504 in the client's shape) and its
record is stored with what it was waiting for: ``client_stalled`` when its client had not
read what was written to it (the agent's doing: no infrastructure cause), else
``deadline_exceeded`` (storage.integrity's cause of that name).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aiohttp import web

from tracetap.proxy.http.errors import ProxyError
from tracetap.proxy.runtime.settings import Settings

if TYPE_CHECKING:
    from tracetap.proxy.call.driver import ModelCall

STATUS = "deadline_exceeded"
CLIENT_STALLED = "client_stalled"


class Deadline:
    """``async with``: the call's driver, ended past ``settings.call_deadline`` seconds (0:
    never). Past it before the reply began, the block is left with ``response`` set (the
    504); past it mid-stream, the stream is cut and the block raises CancelledError, as
    when a client goes away. An async context manager, not a wrapper of the driver: the
    driver runs in ModelCall's own frame (tests/test_walk.py)."""

    def __init__(self, call: ModelCall, request: web.Request, settings: Settings):
        self.call, self.request = call, request
        self.seconds = settings.call_deadline
        self._timer = asyncio.timeout(self.seconds or None)
        self.response: web.StreamResponse | None = None

    async def __aenter__(self) -> Deadline:
        await self._timer.__aenter__()
        return self

    async def __aexit__(self, kind, error, traceback) -> bool:
        try:
            await self._timer.__aexit__(kind, error, traceback)
        except TimeoutError:
            if not self._timer.expired():
                raise  # a timeout of the call's own, not the deadline
            return self._passed()
        return False

    def _passed(self) -> bool:
        call = self.call
        message = f"the call ran past its deadline (--call-deadline {self.seconds:g} s)"
        if not call.relaying:
            self.response = call.fail(ProxyError(504, message, "server_error", STATUS), STATUS)
            return True  # the block is left; the driver returns the 504
        transport = self.request.transport
        unread = transport.get_write_buffer_size() if transport is not None else 0
        if unread:
            call.abort(CLIENT_STALLED, f"{message}: its stream was cut, {unread} bytes "
                       "written to the client that it had not read")
        else:
            call.abort(STATUS, f"{message}: its stream was cut, the upstream had not "
                       "finished it")
        if transport is not None:
            transport.abort()
        # The stream cannot become an error reply: the handler ends as for a client gone.
        raise asyncio.CancelledError
