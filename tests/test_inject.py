"""The proxy asks for what capture needs and removes it again before the client sees it."""

from __future__ import annotations

import json

from proxy.inject import CHAT, COMPLETIONS, prepare, strip_body, strip_chunk


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
