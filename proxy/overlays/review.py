"""Pre-action review: the model's reply is held, ``after_model`` accepts, rewrites or
vetoes it, and a vetoed turn is sampled again with the overlay's feedback.

A streamed reply is buffered to its end, then replayed to the client in its own API: the
client's first byte waits for the whole generation (of every attempt). An overlay that
judges tool calls only (``after_model_sees = "tool_calls"``) gets the text before the
first tool call relayed live instead (``overlays.live``); the client then gets the
accepted turn's tool calls after it. Each attempt is its own call record; a vetoed one
has status "vetoed" and is journaled before the next is asked, the delivered one before
the client sees its end.
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from tracetap.proxy.apis.chat.reply import read_reply
from tracetap.proxy.capture import ModelCall
from tracetap.proxy.errors import ProxyError
from tracetap.proxy.headers import response_headers
from tracetap.proxy.ids import uuid7
from tracetap.proxy.overlays import deliver
from tracetap.proxy.overlays.hooks import ModelReply, OverlayLog, Rewrite, ToolCall, Veto
from tracetap.proxy.overlays.live import LiveStream, broken, read_stream
from tracetap.proxy.sse import Event
from tracetap.proxy.upstream import Reply, UpstreamBroken

if TYPE_CHECKING:
    from tracetap.proxy.overlays.runner import Session
    from tracetap.proxy.routing import Route

Send = Callable[["ModelCall", bytes], Awaitable[tuple[Any, Reply]]]


async def review(
    session: Session, request: web.Request, call: ModelCall, route: Route, send: Send, body: bytes
) -> web.StreamResponse:
    """Send, hold the reply, let the overlay judge it; re-sample while it vetoes."""
    harness = session.harness
    # An overlay that judges tool calls only gets the text before them relayed live.
    live = LiveStream(request) if call.stream and session.sees_tool_calls_only else None
    attempt, first = call, None
    for number in range(session.overlays.max_resamples + 1):
        verdict = None
        try:
            target, reply = await send(attempt, body)
            attempt.replied(target.base_url, reply.status)
            if live is not None and number == 0 and reply.status == 200 and _streamed(
                    attempt, reply):
                out = await live.relay(attempt, reply)
            else:
                out = await _hold(attempt, reply)
            chat = _model_reply(attempt, reply)
            if chat is None:  # an error, or nothing readable: the client gets it as it came
                break
            if session.sees_tool_calls_only and not _tool_calls(chat):
                break  # nothing to judge (a stream's text went out live already)
            first = first or chat
            seen = len(session.log.events)
            verdict = await session.hook(
                "after_model",
                _proposed(chat, attempt, number),
                session.episode.state,
                returns=(Rewrite, Veto),
            )
        except ProxyError as error:
            started = live is not None and live.response is not None
            if attempt is not call or started:  # else the handler records its own call
                attempt.status = (
                    "upstream_error" if error.code == "upstream_error" else "overlay_failed"
                )
                attempt.error = error.message
            if attempt is not call:
                attempt.http_status = error.status
                attempt.journal()
                _spend(attempt)
            if started:  # the client's stream has begun: it cannot become an error reply
                return live.cut()
            raise
        if isinstance(verdict, Rewrite):
            session.event("after_model", "rewrite", verdict.reason)
            break
        if not isinstance(verdict, Veto):
            if len(session.log.events) == seen:  # else it failed open, and said so
                session.event("after_model", "accept")
            break
        if number == session.overlays.max_resamples:
            session.event("after_model", "resample_limit", verdict.reason)
            break
        session.event("after_model", "veto", verdict.reason)
        attempt.status = "vetoed"
        attempt.error = f"vetoed by overlay {session.episode.name!r}: {verdict.reason}"[:1000]
        attempt.journal()
        if attempt is not call:
            _spend(attempt)
        # The rejected turn and the feedback stay in the model's context (overlays.context).
        session.episode.context.add(
            harness, len(harness), [_assistant(chat), {"role": "user", "content": verdict.feedback}]
        )
        attempt, body = _resample(session, call, route, attempt, number + 1)
    started = live is not None and live.response is not None
    if chat is not None and (isinstance(verdict, Rewrite) or (started and attempt is not call)):
        out = _replaced(session, attempt, reply, chat, verdict, live, first)
    attempt.journal()  # journaled before the client sees the end of the reply
    if attempt is not call:
        _spend(attempt)
    if started:
        # A re-sample that failed leaves the live stream no good ending.
        return live.cut() if chat is None and attempt is not call else await live.finish(out)
    response_class = web.StreamResponse if _streamed(attempt, reply) else web.Response
    response = response_class(status=reply.status, headers=response_headers(reply.headers.items()))
    if isinstance(response, web.Response):
        response.body = out
        return response
    try:
        await response.prepare(request)
        await response.write(out)
        await response.write_eof()
    except ConnectionResetError:
        pass  # the harness went away; the record is journaled already
    return response


def _replaced(
    session: Session,
    attempt: ModelCall,
    reply: Reply,
    chat: dict[str, Any],
    verdict: Rewrite | Veto | None,
    live: LiveStream | None,
    first: dict[str, Any] | None,
) -> bytes:
    """What the client gets when it is not the accepted attempt's reply as it came: a
    rewrite; or, on a live stream, the accepted turn's tool calls after the text the
    client already has (that text is the first attempt's)."""
    if live is None or live.response is None:
        rewritten = deliver.rewritten_chat(chat, verdict)
        shown = deliver.client_body(attempt, rewritten)
        session.log.delivered = shown.decode("utf-8", "replace")
        return deliver.client_stream(attempt, rewritten) if _streamed(attempt, reply) else shown
    rewrite = isinstance(verdict, Rewrite)
    tool_calls = verdict.tool_calls if rewrite else _proposed(chat, attempt, 0).tool_calls
    turn = deliver.rewritten_chat(
        chat, Rewrite(content=live.sent_text or None, tool_calls=tool_calls)
    )
    turn.update(id=(first or chat).get("id"), created=(first or chat).get("created"))
    sampled = (chat["choices"][0].get("message") or {}).get("content") or ""  # as sampled
    if rewrite or sampled != live.sent_text:
        session.log.delivered = deliver.client_body(attempt, turn).decode("utf-8", "replace")
    return deliver.client_tail(attempt, turn, live.translator)


def _streamed(call: ModelCall, reply: Reply) -> bool:
    return call.stream and reply.content_type == "text/event-stream"


async def _hold(call: ModelCall, reply: Reply) -> bytes:
    """The whole reply, captured; returns what the client would get for it. Nothing has
    reached the client yet, so a broken upstream gets it a clean error, not a cut stream."""
    if _streamed(call, reply):

        async def held(event: Event) -> bytes:
            return call.on_event(event)

        return await read_stream(call, reply, held)
    try:
        raw = await reply.read()
    except UpstreamBroken as exc:
        raise broken(call, exc) from exc
    finally:
        reply.close()
    return call.reply_body(raw)


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
        tools=copy.deepcopy(call.payload.get("tools")),
        attempt=number,
    )


def _assistant(chat: dict[str, Any]) -> dict[str, Any]:
    """The rejected turn as the next request's assistant message."""
    message = (chat.get("choices") or [{}])[0].get("message") or {}
    out = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    return out


def _resample(
    session: Session, call: ModelCall, route: Route, previous: ModelCall, number: int
) -> tuple[ModelCall, bytes]:
    """A new call record for the next attempt: the harness's request, the model's view."""
    state = call.state
    attempt = ModelCall(state, route, uuid7())
    attempt.episode_id = call.episode_id
    attempt.seq = state.arrivals.next(call.episode_id)
    attempt.policy_version = call.policy_version
    attempt.reservation = call.reservation  # its tokens count against the same budget
    attempt.parse_request((call.request_text or "").encode())
    session.log = attempt.overlay = OverlayLog(
        name=session.episode.name, attempt=number, retry_of=previous.call_id
    )
    body = session.model_body(attempt, attempt.payload["messages"])
    attempt.sending()
    return attempt, body


def _spend(call: ModelCall) -> None:
    """Budgets count every attempt (the handler counts the first)."""
    prompt_tokens, completion_tokens = call.capture.tokens()
    call.state.budgets.spend(call.reservation, (prompt_tokens or 0) + (completion_tokens or 0))
