"""A stream relayed live up to its first tool call, for an ``after_model`` that judges
tool calls only (``after_model_sees = "tool_calls"``, docs/overlays.md).

Text and reasoning before the first tool-call delta reach the client as they come; from
that delta on (and the stream's end marker, so the call is journaled before the client
sees its end) the client's bytes are held for the hook. The client stream's translator is
kept as it was before the first tool call, so a replaced ending (a re-sample's tool calls,
a rewrite) continues the same well-formed stream in the client's API.
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from tracetap.proxy.apis.chat.wire import Message, decode_chat_text
from tracetap.proxy.errors import ProxyError
from tracetap.proxy.headers import response_headers
from tracetap.proxy.sse import Event, SSEParser
from tracetap.proxy.upstream import Reply, UpstreamBroken

if TYPE_CHECKING:
    from tracetap.proxy.capture import ModelCall


class LiveStream:
    """The client's stream of one reviewed call: what went out live, and what is held."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None  # prepared at the first live byte
        self.sent_text = ""  # the content the client already has
        self.tool_calls = False  # a tool-call delta came: the rest is held
        self.translator: Any = None  # the client's translator before the first tool call

    async def relay(self, call: ModelCall, reply: Reply) -> bytes:
        """Consume the whole reply (captured); returns the held bytes, not yet sent."""
        return await read_stream(call, reply, lambda event: self._event(call, reply, event))

    async def _event(self, call: ModelCall, reply: Reply, event: Event) -> bytes:
        if not self.tool_calls and _tool_call_delta(event.data):
            self.tool_calls = True
            self.translator = copy.deepcopy(call.stream_translator)
        out = call.on_event(event)
        if self.tool_calls or call.done:
            return out
        self.sent_text += _content(event.data)
        if out:
            if self.response is None:
                self.response = web.StreamResponse(
                    status=reply.status, headers=response_headers(reply.headers.items())
                )
                await self.response.prepare(self.request)
            await self.response.write(out)
        return b""

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


async def read_stream(
    call: ModelCall, reply: Reply, each: Callable[[Event], Awaitable[bytes]]
) -> bytes:
    """Every event of a streamed reply through ``each``; returns what it held back. An
    upstream that breaks is a 502 ProxyError (the caller knows whether the client
    already has part of the stream)."""
    parser, held = SSEParser(), bytearray()
    try:
        async for data in reply.iter_chunks():
            call.first_byte()
            for event in parser.feed(data):
                held += await each(event)
        tail = parser.flush()
        if tail is not None:
            held += await each(tail)
        call.upstream_done()
        return bytes(held)
    except UpstreamBroken as exc:
        raise broken(call, exc) from exc
    finally:
        reply.close()


def broken(call: ModelCall, exc: UpstreamBroken) -> ProxyError:
    """The upstream failed mid-reply: recorded on the call, and the error to raise."""
    call.upstream_done()
    call.status, call.error = "upstream_error", str(exc)
    return ProxyError(502, f"upstream failed mid-reply: {exc}", "upstream_error",
                      "upstream_error")


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
