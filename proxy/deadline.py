"""A call's deadline: however a call is stuck, it ends within ``--call-deadline`` seconds.

A stream whose client never reads holds its call in flight for as long as the client
keeps the connection: the relay waits to write, the upstream waits to be read. A pause in
abort mode cuts such a stream only when it can be continued exactly
(proxy.continuation); one that cannot (a request with ``tools``) would hold the pause,
and every other call behind it, for good. The deadline bounds that and every other wait
of a call: past it the call is ended (the upstream reply closed, so the engine aborts it;
a stream already begun is cut, a reply not begun is a 504 in the client's shape) and its
record is stored with what it was waiting for: ``client_stalled`` when its client had not
read what was written to it (the agent's doing: no infrastructure cause), else
``deadline_exceeded`` (storage.integrity's cause of that name).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from aiohttp import web

from tracetap.proxy.errors import ProxyError
from tracetap.proxy.keys import STATE

if TYPE_CHECKING:
    from tracetap.proxy.capture import ModelCall

STATUS = "deadline_exceeded"
CLIENT_STALLED = "client_stalled"


async def bounded(call: ModelCall, request: web.Request,
                  work: Coroutine[Any, Any, Any]) -> web.StreamResponse:
    """``work`` (the call's driver), ended past the deadline (0: none)."""
    seconds = request.app[STATE].settings.call_deadline
    if not seconds:
        return await work
    timer = asyncio.timeout(seconds)
    try:
        async with timer:
            return await work
    except TimeoutError:
        if not timer.expired():
            raise  # a timeout of its own inside the call, not the deadline
    message = f"the call ran past its deadline (--call-deadline {seconds:g} s)"
    if not call.relaying:
        return call.fail(ProxyError(504, message, "server_error", STATUS), STATUS)
    transport = request.transport
    unread = transport.get_write_buffer_size() if transport is not None else 0
    if unread:
        call.abort(CLIENT_STALLED, f"{message}: its stream was cut, {unread} bytes written "
                   "to the client that it had not read")
    else:
        call.abort(STATUS, f"{message}: its stream was cut, the upstream had not finished it")
    if transport is not None:
        transport.abort()
    # The stream cannot become an error reply: the handler ends as for a client gone.
    raise asyncio.CancelledError
