"""Pre-action review: the model's reply is held, ``after_model`` accepts, rewrites or
vetoes it, and a vetoed turn is sampled again with the overlay's feedback.

A streamed reply is buffered to its end, then replayed to the client in its own API: the
client's first byte waits for the whole generation (of every attempt). An overlay that
judges tool calls only (``after_model_sees = "tool_calls"``) gets the text before the
first tool call relayed live instead (``overlays.live``); the client then gets the
accepted turn's tool calls after it. Each attempt is its own call record; a vetoed one
has status "vetoed" and is journaled before the next is asked, the delivered one before
the client sees its end.

The review changes no call's state itself: each attempt is a ``ModelCall``, driven through
its API (``hold``, ``veto``, ``failed``, ``resample``, ``release``), so reading and
capturing the reply, journaling and the budget are the call's own code, as for any call.
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from tracetap.proxy.apis.chat.reply import read_reply
from tracetap.proxy.http.errors import ProxyError
from tracetap.proxy.http.headers import response_headers
from tracetap.proxy.overlays import deliver
from tracetap.proxy.overlays.hooks import ModelReply, OverlayLog, Rewrite, ToolCall, Veto
from tracetap.proxy.overlays.live import LiveStream
from tracetap.proxy.upstream.client import Reply

if TYPE_CHECKING:
    from tracetap.proxy.call.driver import ModelCall
    from tracetap.proxy.overlays.runner import Session

Send = Callable[["ModelCall", bytes], Awaitable[tuple[Any, Reply]]]


async def review(
    session: Session, request: web.Request, call: ModelCall, send: Send, body: bytes
) -> web.StreamResponse:
    """Send, hold the reply, let the overlay judge it; re-sample while it vetoes."""
    run = _Review(session, request, call)
    try:
        out = await run.attempts(send, body)
    except ProxyError as error:
        return run.failed(error)
    return await run.deliver(out)


class _Review:
    """One reviewed call: its attempts (each a ModelCall, which alone changes its own
    state) and what the client is given in the end."""

    def __init__(self, session: Session, request: web.Request, call: ModelCall) -> None:
        self.session = session
        self.request = request
        self.call = call
        # An overlay that judges tool calls only gets the text before them relayed live.
        self.live = LiveStream(request) if call.stream and session.sees_tool_calls_only else None
        self.attempt = call
        self.reply: Reply | None = None  # the attempt's upstream reply
        self.chat: dict[str, Any] | None = None  # its reply as chat, None if none to judge
        self.first: dict[str, Any] | None = None  # the first reply judged
        self.verdict: Rewrite | Veto | None = None

    @property
    def started(self) -> bool:
        return self.live is not None and self.live.started

    async def attempts(self, send: Send, body: bytes) -> bytes:
        """Attempt after attempt until one is not vetoed (or the limit); returns the last
        attempt's held bytes for the client."""
        session = self.session
        limit = session.overlays.max_resamples
        for number in range(limit + 1):
            out = await self._sample(send, body, number)
            verdict = self.verdict = None if self.chat is None else await self._judge(number)
            if not isinstance(verdict, Veto):
                return out
            if number == limit:
                session.event("after_model", "resample_limit", verdict.reason)
                return out
            session.event("after_model", "veto", verdict.reason)
            self.attempt.veto(f"vetoed by overlay {session.episode.name!r}: {verdict.reason}")
            # The rejected turn and the feedback stay in the model's context (overlays.context).
            harness = session.harness
            session.episode.context.add(harness, len(harness), [
                _assistant(self.chat), {"role": "user", "content": verdict.feedback}])
            body = self._resample(number + 1)
        raise AssertionError("unreachable: the last attempt returns")

    async def _sample(self, send: Send, body: bytes, number: int) -> bytes:
        """One attempt sent and its whole reply held (the first one's text live, when the
        overlay judges tool calls only)."""
        attempt = self.attempt
        target, reply = await send(attempt, body)
        self.reply = reply
        attempt.replied(target.base_url, reply.status)
        live = self.live
        if live is not None and number == 0 and reply.status == 200 and _streamed(attempt, reply):
            out = await attempt.hold(reply, live.of(reply))
        else:
            out = await attempt.hold(reply)
        self.chat = _model_reply(attempt, reply)
        return out

    async def _judge(self, number: int) -> Rewrite | Veto | None:
        session, chat = self.session, self.chat
        if session.sees_tool_calls_only and not _tool_calls(chat):
            return None  # nothing to judge (a stream's text went out live already)
        self.first = self.first or chat
        seen = len(session.log.events)
        verdict = await session.hook(
            "after_model", _proposed(chat, self.attempt, number), session.episode.state,
            returns=(Rewrite, Veto),
        )
        if isinstance(verdict, Rewrite):
            session.event("after_model", "rewrite", verdict.reason)
        elif verdict is None and len(session.log.events) == seen:  # else it failed open
            session.event("after_model", "accept")
        return verdict

    def _resample(self, number: int) -> bytes:
        """The next attempt, a new call record: the harness's request, the model's view."""
        session, previous = self.session, self.attempt
        attempt = self.attempt = previous.resample()
        session.log = OverlayLog(name=session.episode.name, attempt=number,
                                 retry_of=previous.call_id, patch=session.patch)
        attempt.under_overlay(session.log)
        body = session.model_body(attempt, attempt.request.payload["messages"])
        attempt.sending()
        return body

    def failed(self, error: ProxyError) -> web.StreamResponse:
        """The upstream broke or the overlay failed closed."""
        started = self.started
        if self.attempt is not self.call or started:  # else the handler records its own call
            self.attempt.failed(error)
        if started:  # the client's stream has begun: it cannot become an error reply
            return self.live.cut()
        raise error

    async def deliver(self, out: bytes) -> web.StreamResponse:
        """The last attempt's reply (or its replacement) to the client, journaled first."""
        attempt, reply, live, started = self.attempt, self.reply, self.live, self.started
        resampled = attempt is not self.call
        if self.chat is not None and (isinstance(self.verdict, Rewrite) or (started and resampled)):
            out = self._replaced()
        out = attempt.release(out)  # journaled before the client sees the end of the reply
        if started:
            # A re-sample that failed leaves the live stream no good ending.
            return live.cut() if self.chat is None and resampled else await live.finish(out)
        headers = response_headers(reply.headers.items())
        if not _streamed(attempt, reply):
            return web.Response(status=reply.status, body=out, headers=headers)
        response = web.StreamResponse(status=reply.status, headers=headers)
        try:
            await response.prepare(self.request)
            await response.write(out)
            await response.write_eof()
        except ConnectionResetError:
            pass  # the harness went away; the record is journaled already
        return response

    def _replaced(self) -> bytes:
        """What the client gets when it is not the accepted attempt's reply as it came: a
        rewrite; or, on a live stream, the accepted turn's tool calls after the text the
        client already has (that text is the first attempt's)."""
        session, attempt, chat, verdict, live = (self.session, self.attempt, self.chat,
                                                 self.verdict, self.live)
        if not self.started:
            rewritten = deliver.rewritten_chat(chat, verdict)
            shown = deliver.client_body(attempt, rewritten)
            session.log.delivered = shown.decode("utf-8", "replace")
            streamed = _streamed(attempt, self.reply)
            return deliver.client_stream(attempt, rewritten) if streamed else shown
        rewrite = isinstance(verdict, Rewrite)
        tool_calls = verdict.tool_calls if rewrite else _proposed(chat, attempt, 0).tool_calls
        turn = deliver.rewritten_chat(
            chat, Rewrite(content=live.sent_text or None, tool_calls=tool_calls)
        )
        first = self.first or chat
        turn.update(id=first.get("id"), created=first.get("created"))
        sampled = (chat["choices"][0].get("message") or {}).get("content") or ""  # as sampled
        if rewrite or sampled != live.sent_text:
            session.log.delivered = deliver.client_body(attempt, turn).decode("utf-8", "replace")
        return deliver.client_tail(attempt, turn, live.translator)


def _streamed(call: ModelCall, reply: Reply) -> bool:
    return call.stream and reply.content_type == "text/event-stream"


def _model_reply(call: ModelCall, reply: Reply) -> dict[str, Any] | None:
    """The model's reply as a chat completion (as capture read it), or None if there is
    none to judge: an error status, a cut stream, unreadable data."""
    if reply.status != 200 or call.status != "ok" or call.capture.errors:
        return None
    if _streamed(call, reply) and not call.done:
        return None
    chat = call.capture.reassembled(with_logprobs=False)
    return chat if chat["choices"] else None


def _tool_calls(chat: dict[str, Any]) -> list[Any]:
    return (chat["choices"][0].get("message") or {}).get("tool_calls") or []


def _proposed(chat: dict[str, Any], call: ModelCall, number: int) -> ModelReply:
    reply = read_reply(chat)
    return ModelReply(
        content=reply.text,
        tool_calls=[
            ToolCall(id=t.id, name=t.name, arguments=t.arguments) for t in reply.tool_calls
        ],
        finish_reason=reply.finish_reason,
        tools=copy.deepcopy(call.request.payload.get("tools")),
        attempt=number,
    )


def _assistant(chat: dict[str, Any]) -> dict[str, Any]:
    """The rejected turn as the next request's assistant message."""
    message = (chat.get("choices") or [{}])[0].get("message") or {}
    out = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    return out
