"""The proxy asks for what capture needs and removes it again before the client sees it."""

from __future__ import annotations

import json

import pytest

from tracetap.proxy.apis import Injected
from tracetap.proxy.apis.chat import CHAT, COMPLETIONS
from tracetap.proxy.apis.chat.inject import prepare, strip_body, strip_chunk
from tracetap.proxy.http.errors import ProxyError


def test_chat_stream_on_vllm_asks_for_everything():
    body = {"messages": [], "stream": True}
    injected = prepare(body, CHAT, "vllm")
    assert body["logprobs"] is True and body["top_logprobs"] == 0
    assert body["stream_options"] == {"include_usage": True}
    assert body["return_token_ids"] is True
    assert injected.logprobs and injected.usage and injected.token_ids


def test_openai_flavor_gets_nothing_it_would_reject():
    body = {"messages": []}
    prepare(body, CHAT, "openai")
    assert "return_token_ids" not in body


def test_what_the_client_asked_for_is_left_alone():
    body = {"prompt": "x", "logprobs": 3, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    injected = prepare(body, COMPLETIONS, "vllm")
    assert not injected.any and injected.client_top_logprobs == 3
    assert body["logprobs"] == 3


def test_strip_body_nulls_added_fields_and_keeps_other_bytes():
    injected = prepare({"messages": []}, CHAT, "vllm")
    reply = (b'{"id":"x","prompt_token_ids":[1],"choices":[{"message":{"content":"1.50"},'
             b'"logprobs":{"content":[]},"token_ids":[2]}],"usage":{"x":1.0e-05}}')
    stripped = strip_body(reply, injected)
    assert json.loads(stripped) == {"id": "x", "prompt_token_ids": None, "choices": [
        {"message": {"content": "1.50"}, "logprobs": None, "token_ids": None}],
        "usage": {"x": 1e-05}}
    assert b'"usage":{"x":1.0e-05}' in stripped  # untouched values keep their bytes


def test_strip_chunk_drops_the_added_usage_chunk():
    injected = prepare({"messages": [], "stream": True}, CHAT, "vllm")
    assert strip_chunk(b'{"choices":[],"usage":{"prompt_tokens":1}}', injected) is None
    chunk = strip_chunk(b'{"choices":[{"delta":{"content":"a"},"token_ids":[5],"logprobs":{}}],'
                        b'"usage":null,"prompt_token_ids":[1]}', injected)
    assert json.loads(chunk) == {"choices": [{"delta": {"content": "a"}, "logprobs": None}]}


def test_what_the_client_asked_for_itself_is_known():
    chat = {"messages": [], "logprobs": True}
    assert prepare(chat, CHAT, "vllm").client_top_logprobs == 0
    chat = {"messages": [], "logprobs": True, "top_logprobs": 2}
    injected = prepare(chat, CHAT, "vllm")
    assert injected.client_top_logprobs == 2 and not injected.logprobs
    assert chat["top_logprobs"] == 2  # left alone
    completions = {"prompt": "x", "logprobs": 0}
    assert prepare(completions, COMPLETIONS, "vllm").client_top_logprobs == 0


def test_completions_ask_for_the_sampled_token_only():
    body = {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}}
    injected = prepare(body, COMPLETIONS, "sglang")
    assert body["logprobs"] == 0  # no alternatives: they cost the engine time
    assert injected.logprobs is True and injected.client_top_logprobs == 0
    # The client's other stream options stay.
    assert body["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert injected.usage is True and body["return_token_ids"] is True


def test_strip_body_nulls_token_ids_inside_completion_choices():
    injected = prepare({"prompt": "x"}, COMPLETIONS, "vllm")
    reply = (b'{"id":"c","choices":[{"index":0,"text":"hi","logprobs":{"tokens":["hi"]},'
             b'"prompt_token_ids":[1,2],"token_ids":[3]}]}')
    assert json.loads(strip_body(reply, injected)) == {"id": "c", "choices": [
        {"index": 0, "text": "hi", "logprobs": None, "prompt_token_ids": None,
         "token_ids": None}]}


def test_a_stream_chunk_with_content_is_never_dropped_for_its_usage():
    injected = prepare({"messages": [], "stream": True}, CHAT, "vllm")
    last = (b'{"choices":[{"index":0,"delta":{"content":"end"},"finish_reason":"stop"}],'
            b'"usage":{"prompt_tokens":1,"completion_tokens":1}}')
    chunk = strip_chunk(last, injected)
    assert chunk is not None
    assert json.loads(chunk)["choices"] == [
        {"index": 0, "delta": {"content": "end"}, "finish_reason": "stop"}]
    # The client asked for usage itself: its usage chunk and "usage": null stay.
    own = prepare({"messages": [], "stream": True, "stream_options": {"include_usage": True}},
                  CHAT, "vllm")
    usage = b'{"choices":[],"usage":{"prompt_tokens":1}}'
    assert json.loads(strip_chunk(usage, own)) == json.loads(usage)
    assert json.loads(strip_chunk(b'{"choices":[],"usage":null}', own)) == {
        "choices": [], "usage": None}


def _refusal(body: dict, endpoint: str = CHAT) -> ProxyError:
    with pytest.raises(ProxyError) as raised:
        prepare(body, endpoint, "vllm")
    assert raised.value.status == 400 and raised.value.type == "invalid_request_error"
    return raised.value


@pytest.mark.parametrize(("value", "shown"), [
    ("yes", "'yes'"), (1, "1"), (0.5, "0.5"), ({"a": 1}, "dict"), ([True], "list"),
    ("x" * 60, repr("x" * 60)[:40]),  # a long value is shown cut, never whole
])
def test_a_logprobs_that_is_not_a_boolean_is_a_400_that_shows_what_was_sent(value, shown):
    error = _refusal({"messages": [], "logprobs": value})
    assert (error.message, error.code) == (f"logprobs must be a boolean, got {shown}",
                                           "invalid_logprobs")


@pytest.mark.parametrize(("value", "shown"), [
    (-1, "-1"), (True, "True"), (1.0, "1.0"), ("3", "'3'"), ([2], "list")])
@pytest.mark.parametrize(("endpoint", "key", "base"), [
    (CHAT, "top_logprobs", {"messages": [], "logprobs": True}),
    (COMPLETIONS, "logprobs", {"prompt": "x"})])
def test_a_count_that_is_not_a_non_negative_integer_is_a_400(endpoint, key, base, value,
                                                            shown):
    """-1, a boolean (an int to Python), a float, a string, a list: each a clear 400 with
    its own code, never a crash and never a value silently fixed."""
    error = _refusal({**base, key: value}, endpoint)
    assert (error.message, error.code) == (
        f"{key} must be a non-negative integer, got {shown}", f"invalid_{key}")


def test_the_routed_experts_asked_for_are_stripped_from_every_chunk():
    """--routed-experts: the top-level prompt routing and each choice's routing go, the
    rest of the chunk stays (the routing the client asked for itself is not this case)."""
    injected = Injected(experts=True)
    chunk = strip_chunk(b'{"id":"e","prompt_routed_experts":[[1,2]],"choices":[{"index":0,'
                        b'"delta":{"content":"a"},"routed_experts":[[3]]}]}', injected)
    assert json.loads(chunk) == {"id": "e", "choices": [{"index": 0,
                                                         "delta": {"content": "a"}}]}
    # A chunk without routing (the role chunk, a finish) is left as it is.
    bare = b'{"id":"e","choices":[{"index":0,"delta":{"role":"assistant"}}]}'
    assert strip_chunk(bare, injected) == bare


def test_a_completions_chunk_loses_the_prompt_ids_inside_its_choice():
    """Legacy completions stream the prompt's ids inside the choice (vLLM): gone from the
    chunk with the completion's ids, and nothing else."""
    injected = prepare({"prompt": "x", "stream": True}, COMPLETIONS, "vllm")
    chunk = strip_chunk(b'{"id":"c","choices":[{"index":0,"text":"hi","logprobs":{"x":1},'
                        b'"prompt_token_ids":[1,2],"token_ids":[3]}]}', injected)
    assert json.loads(chunk) == {"id": "c", "choices": [
        {"index": 0, "text": "hi", "logprobs": None}]}
