"""Capture reads token ids in order of trust and reassembles streamed choices."""

from __future__ import annotations

import json

from tracetap.proxy.apis.chat import CHAT, COMPLETIONS
from tracetap.proxy.apis.chat.capture import Capture


def _chunk(**choice) -> bytes:
    return json.dumps({"id": "c", "model": "m", "choices": [{"index": 0, **choice}]}).encode()


def test_engine_ids_win_over_logprob_ids():
    capture = Capture(CHAT)
    capture.add(_chunk(delta={"content": "a"}, token_ids=[7],
                       logprobs={"content": [{"token": "token_id:99", "logprob": -0.5}]}))
    [choice] = capture.choices()
    assert choice.completion_ids == [7] and choice.token_source == "engine"
    assert choice.completion_logprobs == [-0.5]


def test_ids_from_vllm_token_id_strings():
    capture = Capture(CHAT)
    for tid in (11, 12):
        capture.add(_chunk(delta={"content": "x"},
                           logprobs={"content": [{"token": f"token_id:{tid}", "logprob": -1.0}]}))
    [choice] = capture.choices()
    assert choice.completion_ids == [11, 12] and choice.token_source == "logprobs"


def test_ids_from_llamacpp_entries():
    capture = Capture(CHAT)
    capture.add(_chunk(message={"content": "hi"}, logprobs={"content": [
        {"id": 5, "token": "h", "logprob": -0.1}, {"id": 6, "token": "i", "logprob": -0.2}]}))
    [choice] = capture.choices()
    assert choice.completion_ids == [5, 6] and choice.token_source == "logprobs"


def test_text_only_upstream_stores_no_ids_and_counts_missing_logprobs():
    capture = Capture(COMPLETIONS)
    capture.add(_chunk(text="hello", finish_reason="stop"))
    [choice] = capture.choices()
    assert choice.completion_ids is None and choice.token_source == "none"
    assert choice.completion_logprobs is None and capture.logprobs_missing == 1


def test_logprobs_of_the_wrong_length_are_not_stored():
    capture = Capture(CHAT)
    capture.add(_chunk(message={"content": "ab"}, token_ids=[1, 2],
                       logprobs={"content": [{"token": "a", "logprob": -0.1}]}))
    [choice] = capture.choices()
    assert choice.completion_ids == [1, 2] and choice.completion_logprobs is None
    assert capture.logprobs_missing == 1


def test_unparseable_chunks_are_noted_not_raised():
    capture = Capture(CHAT)
    capture.add(b"{garbage")
    capture.add(_chunk(delta={"content": "ok"}, finish_reason="stop"))
    assert capture.errors and capture.choices()[0].text == "ok"


def test_tool_call_deltas_merge_by_index():
    capture = Capture(CHAT)
    capture.add(_chunk(delta={"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                              "function": {"name": "f", "arguments": '{"a"'}}]}))
    capture.add(_chunk(delta={"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                       finish_reason="tool_calls"))
    message = capture.reassembled(with_logprobs=False)["choices"][0]["message"]
    assert message["tool_calls"] == [{"id": "call_1", "type": "function",
                                      "function": {"name": "f", "arguments": '{"a": 1}'}}]


def test_reasoning_is_kept_whichever_field_the_engine_uses():
    """Newer vLLM sends ``reasoning`` where older engines send ``reasoning_content``;
    an engine that sends both with the same text gets it once."""
    for fields in (("reasoning",), ("reasoning_content",), ("reasoning", "reasoning_content")):
        cap = Capture(CHAT)
        for piece in ("Let me ", "think."):
            cap.add(json.dumps({"id": "c", "choices": [
                {"index": 0, "delta": dict.fromkeys(fields, piece)}]}).encode())
        cap.add(json.dumps({"id": "c", "choices": [
            {"index": 0, "delta": {"content": "Done."}, "finish_reason": "stop"}]}).encode())
        message = cap.reassembled(with_logprobs=False)["choices"][0]["message"]
        assert message["reasoning_content"] == "Let me think.", fields
        assert message["content"] == "Done."
