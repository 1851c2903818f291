"""A finished model call as storage keeps it (``storage.records.CallRecord``), and as the
metrics read it (``runtime.metrics.CallOutcome``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from tracetap.proxy.apis.chat.wire import encode
from tracetap.proxy.episodes.lineage import conversation
from tracetap.proxy.episodes.policy_models import OTHER_MODEL
from tracetap.proxy.runtime.metrics import CallOutcome
from tracetap.storage.records import CallRecord

if TYPE_CHECKING:
    from tracetap.proxy.call.driver import ModelCall
    from tracetap.proxy.call.request import CallRequest


def call_outcome(call: ModelCall, elapsed: float) -> CallOutcome:
    """What the metrics count of ``call``: values, so that they never hold the call."""
    timings = call.timings
    return CallOutcome(
        route=call.label, stream=call.stream, http_status=call.http_status or 0,
        client_gone=call.status == "client_disconnected", elapsed=elapsed,
        upstream_latency=timings.upstream_latency, overhead=timings.overhead(elapsed),
        ttft=timings.ttft, dropped=call.request.dropped.counts,
        fields_dropped=call.request.fields_dropped, capture=call.capture)


def _prompt(call: ModelCall) -> tuple[bytes | None, list[int] | None, str | None]:
    """The prompt's ids as the record carries them: packed as decoded (chat streams: no
    list of the prompt is made), the engine's list, or a completions request's own token
    prompt; and where they came from when not from the engine."""
    capture = call.capture
    prompt_packed = getattr(capture, "prompt_packed", None)
    if prompt_packed is not None:
        return prompt_packed, None, None
    if capture.prompt_ids is None and call.api.prompt_in_request:
        ids = _token_prompt(call.request.payload.get("prompt"))
        return None, ids, None if ids is None else "request"
    return None, capture.prompt_ids, None


def call_record(call: ModelCall) -> CallRecord:
    """The record storage keeps of ``call``, at its end: the reassembled response in the
    client's API, the engine's ids, the timings. Notes capture's errors on the call."""
    services = call.services
    request = call.request
    capture = call.capture
    choices = capture.choices()
    other = request.other_model  # another model than the policy: never stamped with it
    if not other:
        call.versions.stamp(choices)  # per-token policy versions, for off-policy tokens
    if request.experts is not None:  # MoE routing per completion token, for replay
        request.experts.stamp(choices, capture.prompt_ids)
        capture.errors.extend(request.experts.errors)
    if capture.errors and call.error is None:
        call.error = "; ".join(capture.errors)
    if request.stream and capture.response_id is not None:
        reassembled = capture.reassembled(with_logprobs=not request.injected.logprobs)
        if call.translation is not None:
            reassembled = call.translation.from_chat(reassembled, request.client_payload)
        response = encode(reassembled)
    else:
        response = call.client_body
    prompt_tokens, completion_tokens = capture.tokens()
    prompt_packed, prompt_ids, prompt_source = _prompt(call)
    model = capture.model or request.model
    return CallRecord(
        call_id=call.call_id,
        episode_id=call.episode_id,
        seq=services.arrivals.next(call.episode_id) if call.seq is None else call.seq,
        instance=services.instance,
        endpoint=call.endpoint,
        model=model,
        policy_version=None if other else call.policy_version,
        stream=request.stream,
        upstream=call.upstream_url,
        request=client_text(request.body),
        response=None if response is None else response.decode("utf-8", "replace"),
        status=OTHER_MODEL if other and call.status == "ok" else call.status,
        http_status=call.http_status,
        error=call.error,
        t_start=call.timings.t_start,
        t_first_byte=call.timings.t_first_byte,
        t_end=time.time(),
        upstream_latency=call.timings.upstream_latency,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        prompt_ids=prompt_ids,
        prompt_ids_packed=prompt_packed,
        prompt_source=prompt_source,
        upstream_request=None
        if request.upstream_request is None
        else request.upstream_request.decode("utf-8", "replace"),
        overlay=None if call.overlay is None else encode(call.overlay).decode(),
        translation_dropped=request.dropped.encoded(),
        lineage=call.lineage[0],
        parent_lineage=call.lineage[1],
        # The client's view: a harness whose calls are translated only some of the time
        # (--translate auto), or run under an overlay, hashes the same start either way.
        conversation=conversation(services.readers.reader(call.endpoint),
                                  _client_view(request)),
        choices=choices,
    )


def _token_prompt(prompt: Any) -> list[int] | None:
    """A completions prompt given as token ids is the prompt's ids."""
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None


def client_text(body: bytes | None) -> str | None:
    """The client's request as a record stores it: decoded only as the record is built,
    so a call in flight holds its prompt once, as bytes."""
    return None if body is None else body.decode("utf-8", "replace")


def journaled(call: ModelCall) -> tuple[CallRecord, bytes | None]:
    """What the driver submits to storage: the record, and the client's body when the
    journal may write it in place of the record's request (``request_utf8``)."""
    record = call_record(call)
    return record, request_utf8(record, call.request.body)


def request_utf8(record: CallRecord, body: bytes | None) -> bytes | None:
    """``body`` when the record's request is its very text (``client_text`` replaced no
    byte: a U+FFFD in the text may be one it put there), for the journal to write as it is
    (storage.journal_record.pieces); else None (the journal encodes the text)."""
    text = record.request
    if body is None or text is None or "\ufffd" in text:
        return None
    return body


def _client_view(request: CallRequest) -> dict[str, Any]:
    """The request as the harness sent it, for what the record derives from the client's
    side (its conversation): an overlay's additions are the model's view, not the
    harness's, so a message injected before the first user turn must not make each call
    look like a new conversation. Read here from the request's fields, not asked of it:
    the call's walk visits the request's room twice (tests/test_walk.py)."""
    if request.client_payload:
        return request.client_payload
    if request.harness_messages is None:
        return request.payload
    return {**request.payload, "messages": request.harness_messages}
