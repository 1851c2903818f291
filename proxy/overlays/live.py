"""A stream relayed live up to its first tool call, for an ``after_model`` that judges
tool calls only (``after_model_sees = "tool_calls"``, docs/overlays.md).

Text and reasoning before the first tool-call delta reach the client as they come; from
that delta on (and the stream's end marker, so the call is journaled before the client
sees its end) the client's bytes are held for the hook. The client stream's translator is
kept as it was before the first tool call, so a replaced ending (a re-sample's tool calls,
a rewrite) continues the same well-formed stream in the client's API. The stream is read,
captured and rewritten by the call's own relay (``ModelCall.hold``, ``proxy.call.relay``):
this only says which events wait, and writes the others.
"""

from __future__ import annotations

import copy
from typing import Any

import msgspec
from aiohttp import web

from tracetap.proxy.apis.chat.wire import Message, decode_chat_text
from tracetap.proxy.http.headers import response_headers
from tracetap.proxy.http.sse import Event
from tracetap.proxy.upstream.client import Reply


class LiveStream:
    """The client's stream of one reviewed call: what went out live, and what is held.
    It is the ``proxy.call.relay.Hold`` that ``ModelCall.hold`` reads the first attempt with:
    the call's relay asks it which events wait, and gives it the rest to write."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.reply: Reply | None = None  # the upstream's reply whose text goes out live
        self.response: web.StreamResponse | None = None  # prepared at the first live byte
        self.sent_text = ""  # the content the client already has
        self.tool_calls = False  # a tool-call delta came: the rest is held
        self.translator: Any = None  # the client's translator before the first tool call

    def of(self, reply: Reply) -> LiveStream:
        """Relay ``reply``'s text live (its status and headers start the client's stream)."""
        self.reply = reply
        return self

    @property
    def started(self) -> bool:
        """Whether the client's stream has begun (it cannot become an error reply)."""
        return self.response is not None

    # -- proxy.call.relay.Hold ---------------------------------------------------------------
    def held(self, event: Event, translator: Any) -> bool:
        if not self.tool_calls and _tool_call_delta(event.data):
            self.tool_calls = True
            self.translator = copy.deepcopy(translator)
        return self.tool_calls

    def sent(self, event: Event) -> None:
        self.sent_text += _content(event.data)

    async def write(self, piece: bytes) -> None:
        if self.response is None:
            reply = self.reply
            assert reply is not None
            self.response = web.StreamResponse(
                status=reply.status, headers=response_headers(reply.headers.items())
            )
            await self.response.prepare(self.request)
        await self.response.write(piece)

    # -- the end ------------------------------------------------------------------------
    async def finish(self, out: bytes) -> web.StreamResponse:
        """The held (or replaced) ending, after the call was journaled."""
        assert self.response is not None
        try:
            await self.response.write(out)
            await self.response.write_eof()
        except ConnectionResetError:
            pass  # the harness went away; the record is journaled already
        return self.response

    def cut(self) -> web.StreamResponse:
        """End a stream that cannot end well (the upstream broke, an overlay failed
        closed) the way an upstream breaking mid-stream ends it: abruptly."""
        assert self.response is not None
        if self.request.transport is not None:
            self.request.transport.abort()
        return self.response


def _deltas(data: bytes | None) -> list[Message]:
    """The chunk's deltas, read through the chat wire Structs (``proxy.apis.chat.wire``)."""
    try:
        body = decode_chat_text(data) if data else None
    except (msgspec.DecodeError, msgspec.ValidationError):
        return []  # capture counts it
    return [c.delta for c in body.choices if c.delta is not None] if body is not None else []


def _tool_call_delta(data: bytes | None) -> bool:
    if data is None or b'"tool_calls"' not in data:
        return False
    return any(d.tool_calls for d in _deltas(data))


def _content(data: bytes | None) -> str:
    if data is None or b'"content"' not in data:
        return ""
    return "".join(d.content for d in _deltas(data) if d.content)
