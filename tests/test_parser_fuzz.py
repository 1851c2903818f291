"""Random and truncated input never crashes the request parser or the stream reassembler."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from tracetap.proxy.apis.chat import CHAT, COMPLETIONS
from tracetap.proxy.apis.chat.capture import Capture
from tracetap.proxy.apis.fields import RequestFields
from tracetap.proxy.apis.routing import Routing
from tracetap.proxy.call.driver import ModelCall
from tracetap.proxy.episodes.model_map import ModelMap
from tracetap.proxy.episodes.repair import Repair
from tracetap.proxy.http.errors import ProxyError
from tracetap.proxy.http.sse import SSEParser
from tracetap.proxy.tokens.prompt_prefix import PromptPrefixes

_STATE = SimpleNamespace(flavor="vllm", model_map=ModelMap(), repair=Repair(False),
                         routing=Routing("auto", native={}), prompt_prefixes=PromptPrefixes(),
                         request_fields=RequestFields(), routed_experts=False)
_CHAT_ROUTE = Routing("auto", native={}).route("/v1/chat/completions", "vllm")
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_request_parser_accepts_or_answers_400(body):
    call = ModelCall(_STATE, _CHAT_ROUTE, "id")
    try:
        out = call.parse_request(body)
    except ProxyError as error:
        assert error.status == 400
    else:
        assert isinstance(json.loads(out), dict)


def _valid_stream(texts: list[str]) -> bytes:
    events = []
    for i, text in enumerate(texts):
        events.append({"id": "c", "model": "m", "choices": [{
            "index": 0, "delta": {"content": text}, "token_ids": [i],
            "logprobs": {"content": [{"token": text, "logprob": -0.5}]},
            "finish_reason": "stop" if i == len(texts) - 1 else None}]})
    events.append({"id": "c", "choices": [], "usage": {"prompt_tokens": 1,
                                                       "completion_tokens": len(texts)}})
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return body + b"data: [DONE]\n\n"


def _reassemble(stream: bytes, cuts: list[int], endpoint: str) -> Capture:
    capture = Capture(endpoint)
    parser = SSEParser()
    bounds = sorted({c % (len(stream) + 1) for c in cuts})
    for a, b in zip([0, *bounds], [*bounds, len(stream)]):
        for event in parser.feed(stream[a:b]):
            if event.data and event.data != b"[DONE]":
                capture.add(event.data)
    tail = parser.flush()
    if tail is not None and tail.data:
        capture.add(tail.data)
    capture.choices()
    capture.reassembled(with_logprobs=True)
    return capture


@settings(max_examples=200)
@given(st.lists(st.text(max_size=5), min_size=1, max_size=8), st.lists(st.integers(0, 10**6)),
       st.integers(0, 10**6))
def test_truncated_streams_reassemble_a_prefix(texts, cuts, keep):
    stream = _valid_stream(texts)
    truncated = stream[: keep % (len(stream) + 1)]
    capture = _reassemble(truncated, cuts, CHAT)
    [choice] = capture.choices() or [None]
    if choice is not None and choice.completion_ids is not None:
        n = len(choice.completion_ids)
        assert choice.completion_ids == list(range(n))
        assert "".join(texts[:n]) == (choice.text or "")


@given(st.binary(max_size=400), st.lists(st.integers(0, 500)),
       st.sampled_from([CHAT, COMPLETIONS]))
def test_random_bytes_never_crash_the_reassembler(stream, cuts, endpoint):
    _reassemble(stream, cuts, endpoint)


@given(json_values, st.sampled_from([CHAT, COMPLETIONS]))
def test_json_of_the_wrong_shape_is_noted_not_raised(value, endpoint):
    capture = Capture(endpoint)
    capture.add(json.dumps(value).encode())
    capture.choices()
    capture.reassembled(with_logprobs=True)


def test_the_shared_machine_profile_is_in_effect():
    if os.environ.get("HYPOTHESIS_PROFILE", "shared-2-core") == "shared-2-core":
        assert settings().deadline == timedelta(seconds=5)
