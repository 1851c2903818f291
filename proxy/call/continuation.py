"""A weight sync loses no rollout: calls cut by a pause in abort mode are continued.

``POST /tracetap/pause {"mode": "abort"}`` cuts the calls in flight at the engine (the
proxy closes their upstream connection: vLLM and SGLang abort a request whose client
went away), holds them (out of the in-flight count, so the sync need not wait), and,
once the proxy resumes, finishes each one so that the agent sees one uninterrupted
answer:

- **continued exactly** (a chat stream whose engine returned its prompt ids and the ids
  sampled so far, one choice, no ``tools`` in the request and no reasoning text yet):
  the prompt ids plus the partial completion ids go to the engine's ``/v1/completions``
  as a token-id prompt, with the request's sampling fields and what is left of its token
  cap; the continuation's events are rewritten as chat chunks of the same reply and go
  through capture like any other, so the stored call is one completion whose version
  spans (proxy.policy.versions) say which tokens came from which weights;
- **retried from the start** (a reply not streamed: the engine returns nothing of an
  aborted body): the request is sent again under the new version; the cut attempt is
  stored as its own record (status ``weight_sync_retried``), never trained.

On SGLang a chat stream's ids come only as it ends (``sglext``, proxy.apis.chat.inject), so
closing the connection would lose them: its stream is cut with SGLang's own ``POST
/abort_request {"rid"}`` (the rid is the reply's id), which ends it as a finished one
(``finish_reason: "abort"``) followed by the ids sampled so far. That finish chunk and
the rest of the engine's ending (usage, ``[DONE]``) never reach the client; the ids go
to capture, and the stream is continued as above.

A stream that cannot be continued exactly (a request with tools, whose calls the
engine's tool parser turns into ``tool_calls`` that a raw continuation would not parse;
structured output, whose grammar would start again at the cut; reasoning text; ``n`` > 1;
an engine without ids; nothing sampled yet) is not cut: its
client may hold part of the answer, which a retry could not match. It finishes on the
old weights as a drain-mode pause would let it, and proxy.policy.versions marks its tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from tracetap.proxy.apis.chat.capture import Capture
from tracetap.proxy.apis.chat.wire import ChatBody, decode_chat
from tracetap.proxy.call.record import client_text
from tracetap.proxy.call.relay import broken_error
from tracetap.proxy.episodes.ids import uuid7
from tracetap.proxy.http.errors import ProxyError
from tracetap.proxy.http.sse import SSEParser
from tracetap.proxy.upstream.client import Reply, UpstreamBroken
from tracetap.storage.records import CallRecord

if TYPE_CHECKING:
    from tracetap.proxy.call.driver import ModelCall

log = logging.getLogger("tracetap.continuation")
RETRIED = "weight_sync_retried"  # the status of a cut attempt that was sent again
COMPLETIONS_PATH = "/v1/completions"
# Request fields a continuation keeps: sampling, and the mock engine's own controls.
_SAMPLING = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
             "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
             "logit_bias", "bad_words", "allowed_token_ids", "include_stop_str_in_output")
# Constraints a token-id prompt cannot resume mid-way (the grammar would start again).
_STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex",
               "guided_choice", "guided_grammar", "regex", "ebnf", "json_schema")
Send = Callable[[str, bytes], Awaitable[Reply]]  # (upstream path, body) → the reply


class Cut:
    """One call's registration with the gate: fired by a pause in abort mode. ``abort``:
    how to ask the engine itself to end the request (SGLang), else its connection is
    closed (the engine aborts a request whose client went away)."""

    def __init__(self, call: ModelCall, reply: Reply, stream: bool,
                 abort: Callable[[], Awaitable[None]] | None = None):
        self.call, self.reply, self.stream, self.abort = call, reply, stream, abort
        self.fired = False
        self.ended = False  # the engine's own abort ended the stream (SGLang)
        self.task: asyncio.Future | None = None

    def __call__(self) -> None:
        if self.stream and not continuable(self.call, ids_at_end=self.abort is not None):
            return  # the client holds part of an answer that cannot be continued exactly
        self.fired = True
        if self.abort is None:
            self.reply.close()
        else:
            self.task = asyncio.ensure_future(self.abort())


def sender(pool: Any, call: ModelCall, headers: dict[str, str]) -> Send:
    """Sends a continuation to the upstream that served ``call`` (its episode's)."""
    async def send(path: str, body: bytes) -> Reply:
        _, reply = await pool.send("POST", path, headers, body,
                                   episode_id=call.episode_id, model=call.request.model)
        return reply
    return send


def aborter(pool: Any, call: ModelCall, headers: dict[str, str]):
    """SGLang's abort of ``call``'s request (``/abort_request``, at the engine's root), or
    None where the engine is not SGLang or the call is not a chat stream."""
    if call.services.flavor != "sglang" or not call.api.continuable:
        return None

    async def abort() -> None:
        body = msgspec.json.encode({"rid": call.capture.response_id})
        try:
            _, reply = await pool.send("POST", "/abort_request", headers, body,
                                       episode_id=call.episode_id, model=call.request.model)
            reply.close()
            if reply.status == 200:
                return
            log.warning("SGLang /abort_request answered %d", reply.status)
        except ProxyError as exc:
            log.warning("SGLang /abort_request failed: %s", exc)
        # Not aborted: the stream ends on the old weights, as in a drain (still in flight,
        # so the sync waits for it; its tokens that arrive while paused carry no version).
        call.services.metrics.sync_cuts.labels(outcome="abort_refused").inc()
    return abort


def continuable(call: ModelCall, ids_at_end: bool = False) -> bool:
    """Whether a chat stream cut now can be continued token for token (module doc)."""
    capture = call.capture
    if not call.api.continuable or not isinstance(capture, Capture):
        return False
    payload = call.request.payload
    if payload.get("tools") or (payload.get("n") or 1) != 1:
        return False
    if any(payload.get(k) not in (None, {"type": "text"}) for k in _STRUCTURED):
        return False
    return capture.continuable(ids_at_end) and (not ids_at_end or bool(capture.response_id))


async def stream(call: ModelCall, reply: Reply, pool: Any,
                 headers: dict[str, str]) -> AsyncGenerator[bytes, None]:
    """The upstream's stream for ``call``, continued after a weight sync if it is cut (the
    continuation sent through ``pool`` with ``headers``, to the episode's upstream)."""
    gate = call.services.gate
    abort = aborter(pool, call, headers)
    cut = Cut(call, reply, stream=True, abort=abort)
    gate.cuts.add(cut)
    try:
        try:
            async for data in (reply.iter_chunks() if abort is None else _events(reply, cut)):
                yield data
        except UpstreamBroken:
            if not cut.fired:
                raise
        if not cut.fired or call.done or (abort is not None and not cut.ended):
            return
        if not call.capture.continuable():  # SGLang's abort ended it without the ids
            call.services.metrics.sync_cuts.labels(outcome="ended_without_ids").inc()
            raise UpstreamBroken("the engine's abort ended the stream without its token ids")
        call.services.metrics.sync_cuts.labels(outcome="continued").inc()
        gate.cuts.discard(cut)
        if not await gate.hold():
            raise UpstreamBroken("cut for a weight sync that outlasted --pause-timeout")
        call.versions.restart()
        async for data in _continued(call, sender(pool, call, headers)):
            yield data
    finally:
        gate.cuts.discard(cut)
        if cut.task is not None and not cut.task.done():
            cut.task.cancel()


async def _events(reply: Reply, cut: Cut) -> AsyncIterator[bytes]:
    """An SGLang stream event by event, each as it came; once a cut's abort has ended it
    (its ``finish_reason: "abort"`` chunk), only the ids chunk goes on (to capture: the
    client's copy of it is stripped), not the abort, the usage or ``[DONE]``."""
    parser = SSEParser()
    async for data in reply.iter_chunks():
        for event in parser.feed(data):
            if cut.fired and event.data is not None:
                chunk = _decode_chunk(event.data)
                if not cut.ended and any(c.finish_reason == "abort" for c in chunk.choices):
                    cut.ended = True
                    continue
                if cut.ended and chunk.sglext is None:
                    continue
            yield event.raw


def _decode_chunk(data: bytes) -> ChatBody:
    try:
        return decode_chat(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ChatBody()  # [DONE], or what capture notes as unparseable


async def whole(call: ModelCall, reply: Reply, send: Callable[[], Awaitable[Reply]]) -> Reply:
    """A reply not streamed: when a weight sync cuts it, the request is sent again after
    the resume (its cut attempt stored apart); returns the reply to read."""
    gate = call.services.gate
    while True:
        cut = Cut(call, reply, stream=False)
        gate.cuts.add(cut)
        try:
            body = await reply.read()
        except UpstreamBroken:
            if not cut.fired:
                raise
            body = None
        finally:
            gate.cuts.discard(cut)
        if body is not None:
            return _Read(reply, body)
        await _again(call)  # sent again from its start: the answer is the new version's
        reply = await send()
        call.replied(call.upstream_url or "", reply.status)


async def cuttable(call: ModelCall, send: Callable[[], Awaitable[Any]]) -> Any:
    """``send()`` for a call not streamed, whose engine answers (headers included) only
    once the whole body is ready (vLLM): a weight sync that cuts it while it waits
    cancels the request (which closes its connection), and it is sent again after the
    resume, the cut attempt stored apart. A stream is sent as it is (its headers come at
    once; ``stream`` continues it)."""
    if call.request.stream:
        return await send()
    gate = call.services.gate
    # The call's own task is cancelled, not a task of its own made for each send (two more
    # passes of the loop per call). The cut's cancel is taken back (uncancel); any other
    # one (the deadline, the proxy stopping) still stands, and goes on up.
    task = asyncio.current_task()
    while True:
        fired = []

        def cut(fired=fired) -> None:
            fired.append(True)
            task.cancel()

        gate.cuts.add(cut)
        try:
            return await send()
        except asyncio.CancelledError:
            if not fired or task.uncancel() > 0:
                raise
        finally:
            gate.cuts.discard(cut)
        try:
            await _again(call)
        except UpstreamBroken as exc:  # held past --pause-timeout: the client's 502, not a bug
            raise broken_error(exc) from exc


async def _again(call: ModelCall) -> None:
    """The cut attempt is stored apart; wait for the resume, then start over on the new
    version."""
    call.services.submit(_attempt(call))
    if not await call.rejoin():
        raise UpstreamBroken("cut for a weight sync that outlasted --pause-timeout")


class _Read(Reply):
    """A reply whose body was read already."""

    def __init__(self, reply: Reply, body: bytes):
        self.__dict__.update(reply.__dict__)
        self._body = body

    async def read(self) -> bytes:
        return self._body


def _attempt(call: ModelCall) -> CallRecord:
    """The cut attempt, stored as its own record: never part of the answer."""
    services = call.services
    return CallRecord(
        call_id=uuid7(), episode_id=call.episode_id, seq=services.arrivals.next(call.episode_id),
        instance=services.instance, endpoint=call.endpoint, model=call.model,
        policy_version=call.policy_version, stream=call.stream, upstream=call.upstream_url,
        request=client_text(call.request.body), status=RETRIED, http_status=0,
        error=f"cut for a weight sync and sent again as call {call.call_id}",
        t_start=call.timings.t_start, t_end=time.time())


async def _continued(call: ModelCall, send: Send) -> AsyncIterator[bytes]:
    """The continuation's events, rewritten as chat chunks of the cut reply."""
    capture: Capture = call.capture
    [choice] = capture.choices()
    # Counted now: the choice's ids are the capture's own list, which the continuation's
    # events go on extending (read later, the usage would count the cut's tokens twice).
    partial = len(choice.completion_ids or ())
    top = call.request.injected.client_top_logprobs
    reply = await send(COMPLETIONS_PATH, msgspec.json.encode(_request(call, choice)))
    call.replied(call.upstream_url or "", reply.status)
    if reply.status != 200:
        reply.close()
        raise UpstreamBroken(f"the engine refused the continuation (HTTP {reply.status})")
    parser = SSEParser()
    try:
        async for data in reply.iter_chunks():
            for event in parser.feed(data):
                out = _chat_event(capture, event.data, partial, top)
                if out:
                    yield out
    finally:
        reply.close()


def _request(call: ModelCall, choice: Any) -> dict[str, Any]:
    payload = call.request.payload
    ids = choice.completion_ids or []
    body = {k: payload[k] for k in (*_SAMPLING, *[k for k in payload if k.startswith("mock_")])
            if k in payload}
    body |= {"prompt": [*call.capture.prompt_ids, *ids], "stream": True,
             "return_token_ids": True, "stream_options": {"include_usage": True}}
    cap = payload.get("max_completion_tokens") or payload.get("max_tokens")
    if cap is not None:
        body["max_tokens"] = max(cap - len(ids), 1)
    floor = payload.get("min_tokens")
    if type(floor) is int and floor > 0:  # what is left of the floor, as of the cap
        body["min_tokens"] = max(floor - len(ids), 0)
    if call.request.injected.experts:
        body["return_routed_experts"] = True
    if call.request.injected.logprobs or payload.get("logprobs"):
        body["logprobs"] = max(payload.get("top_logprobs") or 0, 1)
    return body


def _chat_event(capture: Capture, data: bytes | None, partial: int, top: int) -> bytes:
    """One completions SSE event as the chat chunk the cut stream would have sent."""
    if not data:
        return b""
    if data == b"[DONE]":
        return b"data: [DONE]\n\n"
    try:
        body = msgspec.json.decode(data)
    except msgspec.DecodeError:
        capture.errors.append("unparseable continuation event")
        return b""
    if not isinstance(body, dict):
        return b""
    chunk = {"id": capture.response_id, "object": "chat.completion.chunk",
             "created": capture.created, "model": capture.model, "choices": []}
    for c in body.get("choices") or ():
        chunk["choices"].append(_chat_choice(c, top))
    ext = body.get("sglext")
    if isinstance(ext, dict) and ext.get("routed_experts"):  # SGLang's, the whole sequence's
        chunk["sglext"] = {"routed_experts": ext["routed_experts"]}
    usage = body.get("usage")
    if usage:
        completion = (usage.get("completion_tokens") or 0) + partial
        prompt = len(capture.prompt_ids or ())
        chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


def _chat_choice(c: dict[str, Any], k: int) -> dict[str, Any]:
    out: dict[str, Any] = {"index": 0, "delta": {"content": c.get("text") or ""},
                           "finish_reason": c.get("finish_reason")}
    lp = c.get("logprobs")
    if lp and lp.get("tokens") is not None:
        tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
        out["logprobs"] = {"content": [
            {"token": t, "logprob": v,
             "top_logprobs": _top(top, k)}
            for t, v, top in zip(lp["tokens"], lp.get("token_logprobs") or [], tops,
                                 strict=False)]}
    else:
        out["logprobs"] = None
    if c.get("token_ids") is not None:
        out["token_ids"] = c["token_ids"]
    if c.get("routed_experts") is not None:
        out["routed_experts"] = c["routed_experts"]
    return out


def _top(top: dict[str, float] | None, k: int) -> list[dict[str, Any]]:
    """A completions entry's alternatives (the sampled token plus the top k, vLLM's
    legacy shape) as chat's: the k most likely, as the cut stream gave them."""
    best = sorted((top or {}).items(), key=lambda item: -item[1])[:k]
    return [{"token": token, "logprob": value} for token, value in best]
