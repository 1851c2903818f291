"""The fast chunk reader agrees with the tolerant one on every chunk, odd ones included."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetap.proxy.apis.chat.reply import read_chunk, read_chunk_bytes

_text = st.one_of(st.none(), st.text(max_size=8))
_scalar = st.one_of(st.none(), st.integers(-3, 3), st.text(max_size=4), st.booleans())
_tool = st.fixed_dictionaries({}, optional={
    "index": st.one_of(st.integers(0, 3), _scalar), "id": _text,
    "function": st.one_of(_scalar, st.fixed_dictionaries({}, optional={
        "name": _text, "arguments": st.one_of(_text, _scalar)}))})
_choice = st.fixed_dictionaries({}, optional={
    "index": st.one_of(st.integers(0, 2), _scalar),
    "delta": st.one_of(_scalar, st.fixed_dictionaries({}, optional={
        "content": _text, "reasoning_content": _text, "reasoning": _text,
        "tool_calls": st.one_of(_scalar, st.lists(_tool, max_size=2))})),
    "finish_reason": _text, "stop_reason": _scalar,
    "logprobs": st.one_of(st.none(), st.fixed_dictionaries({"content": st.lists(
        st.fixed_dictionaries({"token": st.text(max_size=3), "logprob": st.floats(-5, 0)}),
        max_size=2)}))})
_chunk = st.fixed_dictionaries({}, optional={
    "created": st.one_of(st.integers(0, 10**10), _scalar),
    "choices": st.one_of(_scalar, st.lists(_choice, max_size=2)),
    "usage": st.one_of(_scalar, st.fixed_dictionaries({}, optional={
        "prompt_tokens": st.one_of(st.integers(0, 99), _scalar),
        "completion_tokens": st.one_of(st.integers(0, 99), _scalar),
        "total_tokens": st.one_of(st.integers(0, 99), _scalar)})),
    "error": st.one_of(_scalar, st.fixed_dictionaries({"message": st.text(max_size=5)}))})


@settings(max_examples=500)
@given(_chunk, st.booleans())
def test_the_fast_reader_reads_like_the_tolerant_one(chunk, logprobs):
    expected = read_chunk(chunk)
    if not logprobs:
        expected = msgspec.structs.replace(expected, logprobs=[])
    assert read_chunk_bytes(msgspec.json.encode(chunk), logprobs=logprobs) == expected


def test_a_vllm_chunk_with_ids_and_logprobs():
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None,
                          "logprobs": {"content": [{"token": "hi", "logprob": -0.5}]},
                          "token_ids": [7]}], "prompt_token_ids": [1, 2]}
    fast = read_chunk_bytes(msgspec.json.encode(chunk))
    assert fast.text == "hi" and fast.logprobs == [] and fast.usage is None
    assert read_chunk_bytes(msgspec.json.encode(chunk), logprobs=True).logprobs == [
        {"token": "hi", "logprob": -0.5}]


def test_an_error_sent_in_place_of_a_chunk():
    boom = read_chunk_bytes(b'{"error": {"message": "boom", "type": "server_error"}}')
    assert boom.error == "boom"
    assert read_chunk_bytes(b'{"choices": [{}], "error": 0}').error == "0"
    assert read_chunk_bytes(
        b'{"choices": [{"index": 0, "delta": {"content": "x"}}], "error": "late"}').error is None
