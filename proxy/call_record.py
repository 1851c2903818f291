"""A finished model call as storage keeps it (``storage.records.CallRecord``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from tracetap.proxy.apis.chat import COMPLETIONS
from tracetap.proxy.apis.chat.wire import encode
from tracetap.storage.records import CallRecord

if TYPE_CHECKING:
    from tracetap.proxy.capture import ModelCall


def call_record(call: ModelCall) -> CallRecord:
    """The record storage keeps of ``call``, at its end: the reassembled response in the
    client's API, the engine's ids, the timings. Notes capture's errors on the call."""
    state = call.state
    capture = call.capture
    choices = capture.choices()
    if capture.errors and call.error is None:
        call.error = "; ".join(capture.errors)
    if call.stream and capture.response_id is not None:
        reassembled = capture.reassembled(with_logprobs=not call.injected.logprobs)
        if call.translation is not None:
            reassembled = call.translation.from_chat(reassembled, call.client_payload)
        response = encode(reassembled)
    else:
        response = call.client_body
    prompt_tokens, completion_tokens = capture.tokens()
    # Packed as decoded (chat streams): the record carries the bytes, no list of the prompt.
    prompt_packed = getattr(capture, "prompt_packed", None)
    prompt_ids = None if prompt_packed is not None else capture.prompt_ids
    prompt_source = None
    if prompt_ids is None and prompt_packed is None and call.endpoint == COMPLETIONS:
        prompt_ids = _token_prompt(call.payload.get("prompt"))
        prompt_source = None if prompt_ids is None else "request"
    model = capture.model or call.model
    upstream_latency = None
    if call.perf_upstream_start is not None and call.perf_upstream_end is not None:
        upstream_latency = call.perf_upstream_end - call.perf_upstream_start
    return CallRecord(
        call_id=call.call_id,
        episode_id=call.episode_id,
        seq=state.arrivals.next(call.episode_id) if call.seq is None else call.seq,
        instance=state.instance,
        endpoint=call.endpoint,
        model=model,
        policy_version=call.policy_version,
        stream=call.stream,
        upstream=call.upstream_url,
        request=call.request_text,
        response=None if response is None else response.decode("utf-8", "replace"),
        status=call.status,
        http_status=call.http_status,
        error=call.error,
        t_start=call.t_start,
        t_first_byte=call.t_first_byte,
        t_end=time.time(),
        upstream_latency=upstream_latency,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        prompt_ids=prompt_ids,
        prompt_ids_packed=prompt_packed,
        prompt_source=prompt_source,
        upstream_request=None
        if call.upstream_request is None
        else call.upstream_request.decode("utf-8", "replace"),
        overlay=None if call.overlay is None else encode(call.overlay).decode(),
        translation_dropped=call.dropped.encoded(),
        choices=choices,
    )


def _token_prompt(prompt: Any) -> list[int] | None:
    """A completions prompt given as token ids is the prompt's ids."""
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None
