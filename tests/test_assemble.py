"""Capture reads token ids in order of trust and reassembles streamed choices."""

from __future__ import annotations

import json

import pytest

from tracetap.proxy.apis import Injected
from tracetap.proxy.apis.chat import CHAT, COMPLETIONS
from tracetap.proxy.apis.chat.capture import CHAT_API, Capture, OpenAIApi
from tracetap.proxy.http.sse import Event


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


def test_tool_calls_of_a_whole_message_are_kept_apart_by_position():
    """A non-streaming message's tool calls carry no ``index``: each is its own call, in
    the order the engine gave them (an overlay's review reads them reassembled)."""
    capture = Capture(CHAT)
    capture.add(_chunk(message={"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": "[]"}}]},
        finish_reason="tool_calls"))
    message = capture.reassembled(with_logprobs=False)["choices"][0]["message"]
    assert [(t["id"], t["function"]["name"], t["function"]["arguments"])
            for t in message["tool_calls"]] == [("call_a", "f", "{}"), ("call_b", "g", "[]")]
    assert capture.choices()[0].text is None  # no text: none stored, not ""


def test_streamed_tool_calls_are_told_apart_by_their_index_not_their_place_in_a_delta():
    """Each delta carries one call, always first in its list: the index says which."""
    capture = Capture(CHAT)
    for index, name in ((0, "f"), (1, "g"), (0, None), (1, None)):
        function = {"name": name, "arguments": ""} if name else {"arguments": f"{{{index}}}"}
        call = {"index": index, "function": function}
        if name:
            call.update(id=f"call_{name}", type="function")
        capture.add(_chunk(delta={"tool_calls": [call]}))
    message = capture.reassembled(with_logprobs=False)["choices"][0]["message"]
    assert [(t["id"], t["function"]["name"], t["function"]["arguments"])
            for t in message["tool_calls"]] == [("call_f", "f", "{0}"), ("call_g", "g", "{1}")]


def test_the_role_is_the_engines_whichever_chunk_carries_it():
    capture = Capture(CHAT)
    capture.add(_chunk(delta={"role": "tool", "content": "a"}))
    capture.add(_chunk(delta={"content": "b"}))
    message = capture.reassembled(with_logprobs=False)["choices"][0]["message"]
    assert (message["role"], message["content"]) == ("tool", "ab")


def test_reassembled_logprobs_have_each_apis_own_shape():
    chat = Capture(CHAT)
    for token, logprob in (("a", -0.5), ("b", -1.5)):
        chat.add(_chunk(delta={"content": token},
                        logprobs={"content": [{"token": token, "logprob": logprob}]}))
    assert chat.reassembled(with_logprobs=True)["choices"][0]["logprobs"] == {"content": [
        {"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.5}]}
    completion = Capture(COMPLETIONS)
    completion.add(_chunk(text="ab", logprobs={"tokens": ["a", "b"],
                                               "token_logprobs": [-0.5, -1.5]}))
    assert completion.reassembled(with_logprobs=True)["choices"][0]["logprobs"] == {
        "tokens": ["a", "b"], "token_logprobs": [-0.5, -1.5]}


def test_a_completion_choice_keeps_its_prompt_ids_finish_reason_and_missing_tops():
    """vLLM's completions put ``prompt_token_ids`` in the choice; top logprobs the engine
    left out stay aligned with the tokens (None each)."""
    capture = Capture(COMPLETIONS, keep_top_logprobs=True)
    capture.add(_chunk(text="ab", prompt_token_ids=[3, 4, 5], finish_reason="length",
                       logprobs={"tokens": ["a", "b"], "token_logprobs": [-0.5, -1.5]}))
    [choice] = capture.choices()
    assert capture.prompt_ids == [3, 4, 5]
    assert choice.finish_reason == "length" and choice.top_logprobs == [None, None]


def test_token_counts_are_the_engines_ids_else_the_logprob_entries():
    capture = Capture(CHAT)
    capture.add(json.dumps({"id": "c", "choices": [
        {"index": 0, "delta": {"content": "ab"}, "token_ids": [1, 2, 3]},
        {"index": 1, "delta": {"content": "a"},
         "logprobs": {"content": [{"token": "a", "logprob": -0.5}]}}]}).encode())
    assert capture.token_counts() == {0: 3, 1: 1}
    capture.choices()
    assert capture.choice_count == 2  # counted by the metrics


def test_a_chat_bodys_prompt_ids_are_kept():
    """vLLM's chat puts them beside the choices (when not cut out first: proxy.prompt_cut)."""
    capture = Capture(CHAT)
    capture.add(json.dumps({"id": "c", "prompt_token_ids": [3, 4], "choices": [
        {"index": 0, "message": {"content": "a"}}]}).encode())
    assert capture.prompt_ids == [3, 4]


def _continuable(*chunks: dict, prompt_ids: list[int] | None = None) -> bool:
    capture = Capture(CHAT)
    capture.prompt_ids = prompt_ids
    for choices in chunks:
        capture.add(json.dumps({"id": "c", "choices": choices}).encode())
    return capture.continuable()


_GOING = {"index": 0, "delta": {"content": "a"}, "token_ids": [1]}


@pytest.mark.parametrize("chunk, prompt_ids, expected", [
    (_GOING, [9], True),
    (_GOING, None, False),  # the prompt's ids unknown
    ({**_GOING, "index": 1}, [9], False),  # with choice 0 below: two choices
    ({"index": 0, "delta": {"content": "a"}}, [9], False),  # no engine ids
    ({**_GOING, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}},
     [9], False),
    ({**_GOING, "delta": {"reasoning_content": "hm"}}, [9], False),
    ({**_GOING, "finish_reason": "length"}, [9], False),
], ids=["plain", "no prompt ids", "two choices", "no engine ids", "a tool call", "reasoning",
        "finished"])
def test_only_one_unfinished_plain_choice_with_all_its_ids_can_be_continued(
        chunk, prompt_ids, expected):
    chunks = [[_GOING], [chunk]] if chunk["index"] == 1 else [[chunk]]
    assert _continuable(*chunks, prompt_ids=prompt_ids) is expected


def test_a_wire_api_captures_its_own_endpoint_and_names_its_route():
    api = OpenAIApi(CHAT, "chat_completions", "/v1/chat/completions")
    assert (api.route, api.path) == ("chat_completions", "/v1/chat/completions")
    capture = api.capture(Injected())
    capture.add(_chunk(message={"content": "hi"}))
    assert capture.choices()[0].text == "hi"  # read as chat, not as a completion


def test_a_wire_apis_capture_keeps_top_logprobs_only_when_the_client_asked_for_some():
    api = OpenAIApi(CHAT, "chat_completions", "/v1/chat/completions")
    entry = {"token": "a", "logprob": -0.5, "top_logprobs": [{"token": "a", "logprob": -0.5}]}
    for asked, kept in ((0, None), (1, [[{"token": "a", "logprob": -0.5}]])):
        capture = api.capture(Injected(logprobs=True, client_top_logprobs=asked))
        capture.add(_chunk(delta={"content": "a"}, logprobs={"content": [entry]}))
        assert capture.choices()[0].top_logprobs == kept, asked


def test_a_capture_given_nothing_yet_holds_nothing():
    """What a call broken before its first chunk stores: no model, ids, usage or choices,
    and every count at zero."""
    for endpoint in (CHAT, COMPLETIONS):
        capture = Capture(endpoint)
        assert (capture.endpoint, capture.keep_top, capture.model, capture.response_id,
                capture.created, capture.usage, capture.prompt_ids, capture.prompt_packed) == (
            endpoint, False, None, None, None, None, None, None)
        assert (capture.errors, capture.logprobs_missing, bool(capture.ended), capture.choice_count,
                capture.unknown_events, capture.choices()) == ([], 0, False, 0, 0, [])
        assert capture.tokens() == (None, None) and capture.token_counts() == {}


def test_a_stream_chunk_that_is_only_the_proxys_usage_is_dropped_whole():
    """The client did not ask for usage: the chunk carrying only it is not sent at all."""
    usage = json.dumps({"id": "c", "choices": [], "usage": {"prompt_tokens": 1}}).encode()
    event = Event(raw=b"data: " + usage + b"\n\n", data=usage)
    assert CHAT_API.strip_event(event, Injected(usage=True)) == b""


def test_a_tool_call_keeps_what_its_deltas_left_out_empty_and_the_type_they_gave():
    """An engine may never send a call's id, name or type: reassembled, they are null
    (the type the default ``"function"``); a type it does send is kept."""
    capture = Capture(CHAT)
    capture.add(_chunk(delta={"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}))
    capture.add(_chunk(delta={"tool_calls": [{"index": 1, "type": "custom",
                                              "function": {"arguments": "x"}}]}))
    capture.add(_chunk(delta={"tool_calls": [{"index": 1, "function": {"arguments": "y"}}]}))
    message = capture.reassembled(with_logprobs=False)["choices"][0]["message"]
    assert message["tool_calls"] == [
        {"id": None, "type": "function", "function": {"name": None, "arguments": "{}"}},
        {"id": None, "type": "custom", "function": {"name": None, "arguments": "xy"}}]


def test_chat_top_logprobs_are_kept_per_token_when_the_client_asked_for_them():
    capture = Capture(CHAT, keep_top_logprobs=True)
    capture.add(_chunk(delta={"content": "ab"}, logprobs={"content": [
        {"token": "a", "logprob": -0.5, "top_logprobs": [{"token": "a", "logprob": -0.5},
                                                        {"token": "c", "logprob": -2.0}]},
        {"token": "b", "logprob": -1.5}]}))
    [choice] = capture.choices()
    assert choice.top_logprobs == [[{"token": "a", "logprob": -0.5},
                                    {"token": "c", "logprob": -2.0}], []]

def test_top_logprobs_the_engine_never_sent_are_stored_as_none_not_an_empty_list():
    """The client asked for top logprobs and the engine sent no logprobs at all: the
    choice has none to store (a NULL column, which the viewer's alternatives skip), as
    when the client did not ask."""
    for endpoint, choice in ((CHAT, {"delta": {"content": "a"}}), (COMPLETIONS, {"text": "a"})):
        capture = Capture(endpoint, keep_top_logprobs=True)
        capture.add(_chunk(**choice, finish_reason="stop"))
        [record] = capture.choices()
        assert (record.text, record.top_logprobs) == ("a", None), endpoint



def _stream(*chunks: dict) -> list[bytes]:
    return [json.dumps({"id": "c-1", "model": "m", "created": 5, **chunk}).encode()
            for chunk in chunks]


def test_a_chat_stream_is_reassembled_into_the_whole_reply_it_stands_for():
    """The stored reply of a stream, and what an overlay's review reads: the
    non-streaming body, field for field (no role sent: the assistant's; no text: null)."""
    capture = Capture(CHAT)
    for data in _stream(
            {"choices": [{"index": 0, "delta": {"content": "He"}}]},
            {"choices": [{"index": 1, "delta": {"tool_calls": [
                {"index": 0, "id": "call_1", "function": {"name": "f", "arguments": "{}"}}]}}]},
            {"choices": [{"index": 0, "delta": {"content": "llo"}, "finish_reason": "stop"},
                         {"index": 1, "delta": {}, "finish_reason": "tool_calls"}]},
            {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4,
                                      "total_tokens": 7}}):
        capture.add(data)
    body = capture.reassembled(with_logprobs=False)
    usage = body.pop("usage")
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        3, 4, 7)
    assert body == {
        "id": "c-1", "object": "chat.completion", "created": 5, "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hello"},
             "logprobs": None, "finish_reason": "stop"},
            {"index": 1, "message": {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "f", "arguments": "{}"}}]},
             "logprobs": None, "finish_reason": "tool_calls"}]}


def test_a_completions_stream_is_reassembled_into_the_whole_reply_it_stands_for():
    capture = Capture(COMPLETIONS)
    for data in _stream(
            {"choices": [{"index": 0, "text": "Once",
                          "logprobs": {"tokens": ["Once"], "token_logprobs": [-0.5]}}]},
            {"choices": [{"index": 1, "text": "", "finish_reason": "length"},
                         {"index": 0, "text": "", "finish_reason": "stop"}]}):
        capture.add(data)
    assert capture.reassembled(with_logprobs=False) == {
        "id": "c-1", "object": "text_completion", "created": 5, "model": "m",
        "choices": [{"index": 0, "text": "Once", "logprobs": None, "finish_reason": "stop"},
                    {"index": 1, "text": "", "logprobs": None, "finish_reason": "length"}]}


def test_at_most_five_unparseable_pieces_are_noted_each_saying_what_it_was():
    capture = Capture(CHAT)
    for _ in range(7):
        capture.add(b"{garbage")
    assert len(capture.errors) == 5
    assert all(e.startswith("unparseable upstream data: ") for e in capture.errors)
    capture.add_prompt_ids(b"[1, x]")
    assert capture.prompt_ids is None and len(capture.errors) == 5
    capture = Capture(CHAT)
    for _ in range(4):
        capture.add(b"{garbage")
    capture.add_prompt_ids(b"[1, x]")
    assert capture.prompt_ids is None and len(capture.errors) == 5
    assert capture.errors[-1].startswith("unparseable upstream prompt_token_ids: ")


def test_llamacpp_entries_without_token_strings_still_give_their_ids():
    capture = Capture(CHAT)
    capture.add(_chunk(message={"content": "hi"}, logprobs={"content": [
        {"id": 5, "logprob": -0.1}, {"id": 6, "logprob": -0.2}]}))
    [choice] = capture.choices()
    assert choice.completion_ids == [5, 6] and choice.token_source == "logprobs"


def test_the_engines_token_strings_are_kept_only_for_a_choice_without_ids():
    """Without ids the writer retokenizes the text, and verifies it by the engine's own
    strings; with ids they are not needed."""
    without = Capture(CHAT)
    without.add(_chunk(delta={"content": "ab"}, logprobs={"content": [
        {"token": "a", "logprob": -0.1}, {"token": "b", "logprob": -0.2}]}))
    [choice] = without.choices()
    assert (choice.completion_ids, choice.token_strs) == (None, ["a", "b"])
    assert choice.completion_logprobs == [-0.1, -0.2] and without.logprobs_missing == 0
    with_ids = Capture(CHAT)
    with_ids.add(_chunk(delta={"content": "ab"}, token_ids=[1, 2], logprobs={"content": [
        {"token": "a", "logprob": -0.1}, {"token": "b", "logprob": -0.2}]}))
    [choice] = with_ids.choices()
    assert (choice.completion_ids, choice.token_strs) == ([1, 2], None)
    engine_only = Capture(CHAT)
    engine_only.add(_chunk(delta={"content": "ab"}, token_ids=[1, 2]))
    assert engine_only.choices()[0].token_strs is None


def test_each_choice_without_logprobs_is_counted_missing():
    capture = Capture(COMPLETIONS)
    capture.add(json.dumps({"id": "c", "choices": [
        {"index": 0, "text": "a"}, {"index": 1, "text": "b"}]}).encode())
    capture.choices()
    assert capture.logprobs_missing == 2
