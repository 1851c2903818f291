"""The fast chunk reader agrees with the tolerant one on every chunk, odd ones included."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetap.proxy.apis.chat.reply import (
    Chunk,
    Reply,
    ToolCall,
    ToolDelta,
    Usage,
    read_chunk,
    read_chunk_bytes,
    read_reply,
)

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


def test_a_reply_with_an_odd_typed_field_is_read_field_by_field():
    """One odd field (a numeric role) sends the reply to the tolerant reader: every other
    field is still read, choice 0 wherever it stands, odd values as absent."""
    chat = {"created": 7, "usage": {
        "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 1},
        "completion_tokens_details": {"reasoning_tokens": 1}},
        "choices": [{"index": 1, "message": {"content": "other"}}, {
            "index": 0, "finish_reason": "tool_calls", "stop_reason": 42,
            "logprobs": {"content": [{"token": "a", "logprob": -1.0}, "junk"]},
            "message": {"role": 5, "content": "hi", "reasoning_content": "hm", "tool_calls": [
                {"id": "c1", "function": {"name": "f", "arguments": {"q": 1}}},
                {"function": {"arguments": None}}, "junk",
                {"id": 5, "function": {"name": 5, "arguments": "{}"}}]}}]}
    assert read_reply(chat) == Reply(
        text="hi", reasoning="hm", tool_calls=[
            ToolCall(id="c1", name="f", arguments='{"q":1}'),
            ToolCall(id=None, name=None, arguments=""), ToolCall(id=None, name=None, arguments=""),
            ToolCall(id=None, name=None, arguments="{}")],
        finish_reason="tool_calls", stop_reason=42, logprobs=[{"token": "a", "logprob": -1.0}],
        usage=Usage(prompt=3, completion=2, total=6, cached=1, reasoning=1), created=7)
    empty = Reply(text=None, reasoning=None, tool_calls=[], finish_reason=None,
                  stop_reason=None, logprobs=[], usage=None, created=None)
    assert read_reply([chat]) == empty


def test_a_chunk_with_an_odd_typed_field_is_read_field_by_field():
    chunk = {"created": 9, "usage": {"prompt_tokens": 4, "completion_tokens": 1},
             "choices": [{"index": 0, "finish_reason": "length", "stop_reason": "END",
                          "logprobs": {"content": [{"token": "x", "logprob": -0.5}]},
                          "delta": {"role": 5, "content": "x", "reasoning": "r", "tool_calls": [
                              {"index": 2, "id": "c", "function": {"name": "f",
                                                                   "arguments": '{"a"'}},
                              {"function": {"arguments": 5}}, "junk",
                              {"index": True, "function": "f"}]}}]}
    wanted = Chunk(text="x", reasoning="r", tools=[
        ToolDelta(index=2, id="c", name="f", arguments='{"a"'),
        ToolDelta(index=1, id=None, name=None, arguments=""),
        ToolDelta(index=2, id=None, name=None, arguments=""),
        ToolDelta(index=3, id=None, name=None, arguments="")],
        finish_reason="length", stop_reason="END", logprobs=[{"token": "x", "logprob": -0.5}],
        usage=Usage(prompt=4, completion=1, total=5), created=9, error=None)
    assert read_chunk(chunk) == wanted
    assert read_chunk_bytes(msgspec.json.encode(chunk), logprobs=True) == wanted
    assert read_chunk_bytes(b"[1]") == Chunk(
        text=None, reasoning=None, tools=[], finish_reason=None, stop_reason=None, logprobs=[],
        usage=None, created=None, error=None)


def test_usage_counts_what_is_missing_as_zero_and_keeps_the_engines_total():
    """Either count alone is usage (the other is 0); the engine's total wins over the sum.
    The same on the fast reader and, for a chunk with an odd field, the tolerant one."""
    cases = [({"completion_tokens": 2}, Usage(prompt=0, completion=2, total=2)),
             ({"prompt_tokens": 3}, Usage(prompt=3, completion=0, total=3)),
             ({"prompt_tokens": 3, "completion_tokens": 2}, Usage(prompt=3, completion=2, total=5)),
             ({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 9},
              Usage(prompt=3, completion=2, total=9)),
             ({"total_tokens": 9}, None)]
    for usage, wanted in cases:
        fast = read_chunk_bytes(msgspec.json.encode({"usage": usage}))
        odd = read_chunk_bytes(msgspec.json.encode({"usage": usage, "choices": [
            {"delta": {"role": 5}}]}))
        assert (fast.usage, odd.usage) == (wanted, wanted), usage


def test_fast_tool_deltas_without_an_index_take_their_position_and_errors_keep_their_text():
    chunk = {"choices": [{"index": 0, "delta": {"tool_calls": [
        {"id": "a", "function": {"name": "f", "arguments": "{}"}},
        {"function": {"arguments": "x"}}]}}]}
    tools = read_chunk_bytes(msgspec.json.encode(chunk)).tools
    assert [(t.index, t.id, t.name, t.arguments) for t in tools] == [
        (0, "a", "f", "{}"), (1, None, None, "x")]
    assert read_chunk_bytes(b'{"error": "overloaded"}').error == "overloaded"
