"""OpenAI Responses API ⇄ chat completions: requests, whole replies, streams and errors,
checked against the real ``openai`` SDK types and stream parsers."""

from __future__ import annotations

import json

import msgspec
import openai
import pytest
from helpers.chat_upstreams import CHAT_USAGE as USAGE
from helpers.chat_upstreams import chat_reply, scripted_chat_app, stream_chunks, translating_app
from helpers.translation import decode_named_events, engine_chat, finish_on_last_chunk, harness_turn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tracetap.demo import tokenizer as tok
from tracetap.proxy.apis.dropped import Dropped
from tracetap.proxy.apis.responses import translate as api
from tracetap.proxy.apis.responses.translate import (
    ERRORS,
    StreamTranslator,
    Untranslatable,
    error_from_chat,
    from_chat,
    to_chat,
    untranslatable,
)

EVENTS = TypeAdapter(ResponseStreamEvent)
TOOL = {"type": "function", "name": "lookup", "description": "Look a thing up",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}


def decode_events(raw: list[bytes]) -> list[dict]:
    """SSE bytes → event payloads, checking each event's name against its type."""
    return decode_named_events(raw, EVENTS.validate_python)


def run_stream(request: dict, chunks: list[dict], response_id="resp_t") -> list[dict]:
    translator = StreamTranslator(request, response_id=response_id)
    raw = [event for c in chunks for event in translator.feed(c)] + translator.finish()
    return decode_events(raw)


def assert_done_events_say_what_the_final_response_holds(events: list[dict]) -> None:
    """Each item is added empty, has one content part (index 0), and its done events
    (text, part, arguments, item) are what the final response holds, item by item."""
    final = events[-1]["response"]["output"]
    empty = {"reasoning": {"type": "reasoning_text", "text": ""},
             "message": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}
    for event in events:
        kind, item = event["type"], final[event.get("output_index", 0)] if final else None
        assert event.get("content_index", 0) == 0
        if kind == "response.content_part.added":
            assert event["part"] == empty[item["type"]]
        elif kind == "response.content_part.done":
            assert event["part"] == item["content"][0]
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert event["text"] == item["content"][0]["text"]
        elif kind == "response.function_call_arguments.done":
            assert (event["name"], event["arguments"]) == (item["name"], item["arguments"])
        elif kind == "response.output_item.done":
            assert event["item"] == item
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert done == list(range(len(final)))


def sdk_final(request: dict, events: list[dict]) -> Response:
    """The openai SDK's own stream accumulator over our events."""
    state = ResponseStreamState(input_tools=request.get("tools") or [], text_format=openai.omit)
    for payload in events:
        state.handle_event(EVENTS.validate_python(payload))
    assert state._completed_response is not None
    return state._completed_response


# ---- requests ----------------------------------------------------------------------------


def test_string_input_instructions_and_sampling():
    chat = to_chat({"model": "gpt-x", "instructions": "Be brief.", "input": "Hi",
                    "max_output_tokens": 50, "temperature": 0.2, "top_p": 0.9,
                    "parallel_tool_calls": False, "user": "u1", "store": False,
                    "metadata": {"k": "v"}, "truncation": "auto", "service_tier": "auto"},
                   model_map=lambda name: {"gpt-x": "qwen3-8b"}[name])
    assert chat == {"model": "qwen3-8b",
                    "messages": [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Hi"}],
                    "max_tokens": 50, "temperature": 0.2, "top_p": 0.9,
                    "parallel_tool_calls": False, "user": "u1"}


def test_message_items_roles_and_content_parts():
    chat = to_chat({"input": [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "A pixel.", "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Thanks"}]},
    ]})
    assert chat["messages"] == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA",
                                                "detail": "low"}}]},
        {"role": "assistant", "content": "A pixel."},
        {"role": "user", "content": "Thanks"},
    ]


def test_tools_choice_format_reasoning_and_stream_options():
    chat = to_chat({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function",
                                                                    "name": "lookup"},
                    "text": {"format": {"type": "json_schema", "name": "out", "description": "d",
                                        "schema": {"type": "object"}, "strict": True},
                             "verbosity": "low"},
                    "reasoning": {"effort": "high", "summary": "auto"},
                    "include": ["reasoning.encrypted_content"], "stream": True})
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "lookup", "description": "Look a thing up", "parameters": TOOL["parameters"]}}]
    strict = to_chat({"input": "x", "tools": [{**TOOL, "strict": True}]})["tools"][0]
    assert strict["function"]["strict"] is True
    assert to_chat({"input": "x", "text": {"format": {"type": "json_object"}}})[
        "response_format"] == {"type": "json_object"}
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "out", "schema": {"type": "object"}, "strict": True, "description": "d"}}
    assert chat["reasoning_effort"] == "high"
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert "logprobs" not in chat  # capture adds its own; only a client's ask is translated
    for choice in ("auto", "none", "required"):
        assert to_chat({"input": "x", "tools": [TOOL],
                        "tool_choice": choice})["tool_choice"] == choice
    # vLLM refuses a tool_choice without tools: none left, none sent.
    assert "tool_choice" not in to_chat({"input": "x", "tool_choice": "auto"})
    assert "reasoning_effort" not in to_chat({"input": "x", "reasoning": {"effort": "minimal"}})


def test_client_requested_logprobs_are_translated():
    chat = to_chat({"input": "x", "include": ["message.output_text.logprobs"],
                    "top_logprobs": 3})
    assert chat["logprobs"] is True and chat["top_logprobs"] == 3
    # top_logprobs alone asks for logprobs, from 1 up; neither 0 nor a bool does (the
    # stream translator asks a request to_chat would refuse).
    assert to_chat({"input": "x", "top_logprobs": 1})["top_logprobs"] == 1
    assert "logprobs" not in to_chat({"input": "x", "top_logprobs": 0})
    assert not StreamTranslator({"input": "x", "top_logprobs": True}).wants_logprobs


def test_history_function_calls_join_their_assistant_turn_and_reasoning_is_kept():
    chat = to_chat({"input": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "s"}],
         "content": [{"type": "reasoning_text", "text": "Two cities."}]},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"q":"P"}'},
        {"type": "function_call", "call_id": "c2", "name": "lookup", "arguments": '{"q":"R"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "gAAAA..."},
        {"type": "function_call", "call_id": "c3", "name": "lookup", "arguments": "{}"},
    ]})
    assert chat["messages"] == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Two cities.",
         "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "lookup",
                                                           "arguments": '{"q":"P"}'}},
             {"id": "c2", "type": "function", "function": {"name": "lookup",
                                                           "arguments": '{"q":"R"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "lookup",
                                                          "arguments": "{}"}}]},
    ]


@pytest.mark.parametrize(("request_body", "param", "words"), [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "stored"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "conversation"),
    ({"input": "x", "background": True}, "background", "background"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "template"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "stored"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type", "input_file"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input[0].content[0].image_url", "file_id"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "one of"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type", "grammar"),
    ({}, "input", "required"),
    ({"input": 3}, "input", "array"),
    ({"input": "x", "temperature": "hot"}, "temperature", "number"),
    ({"input": "x", "tools": [TOOL, 3]}, "tools[1]", "`tools[1]` must be a JSON object"),
    ({"input": "x", "tools": [{"type": "function", "name": 3}]}, "tools[0].name",
     "`tools[0].name` must be a string"),
    ({"input": "x", "tool_choice": {"type": "function"}}, "tool_choice.name",
     "`tool_choice.name` must be a string"),
    ({"input": "x", "reasoning": "high"}, "reasoning", "`reasoning` must be a JSON object"),
    ({"input": "x", "include": "message.output_text.logprobs"}, "include",
     "`include` must be an array"),
    ({"input": "x", "text": "json"}, "text", "`text` must be a JSON object"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.name",
     "`text.format.name` must be a string"),
    ({"input": "x", "tools": {"a": TOOL}}, "tools", "`tools` must be an array"),
    ({"input": "x", "instructions": 3}, "instructions", "`instructions` must be a string"),
    ("hi", None, "the request body must be a JSON object"),
    ({"input": "x", "text": {"format": "json"}}, "text.format",
     "`text.format` must be a JSON object"),
    # Each malformed input item or part is named in full, in its param and its message.
    ({"input": None}, "input", "`input` is required (the whole conversation, resent each turn)"),
    ({"input": ["x"]}, "input[0]", "`input[0]` must be a JSON object"),
    ({"input": [{"role": ["user"], "content": "x"}]}, "input[0].role", "`input[0].role` must"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content",
     "`input[0].content` must be a string or an array of content parts"),
    ({"input": [{"role": "user", "content": ["x"]}]}, "input[0].content[0]",
     "`input[0].content[0]` must be a JSON object"),
    *(({"input": [{"role": "assistant", "content": [{"type": kind, key: 5}]}]},
       f"input[0].content[0].{key}", f"`input[0].content[0].{key}` must be a string")
      for kind, key in (("output_text", "text"), ("refusal", "refusal"))),
    *(({"input": [{"type": "function_call", "call_id": "c", "name": "f", key: 5}]},
       f"input[0].{key}", f"`input[0].{key}` must be a string") for key in ("call_id", "name")),
    ({"input": [{"type": "function_call_output", "call_id": 5, "output": "x"}]},
     "input[0].call_id", "`input[0].call_id` must be a string"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]},
     "input[0].output", "`input[0].output` must be a string or an array of content parts"),
    ({"input": [{"type": "reasoning", "content": "x"}]}, "input[0].content",
     "`input[0].content` must be an array"),
    ({"input": [{"type": "reasoning", "content": ["x"]}]}, "input[0].content[0]",
     "`input[0].content[0]` must be a JSON object"),
    ({"input": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": 5}]}]},
     "input[0].content[0].text", "`input[0].content[0].text` must be a string"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type",
     "`input[0]`: an item_reference points at an item stored server-side; send the item "
     "itself"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_image",
                                                   "image_url": "http://x/i.png"}]}]},
     "input[0].content[0].type",
     "`input[0].content[0]`: chat completions accept images only in user messages"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input[0].content[0].image_url", "`input[0].content[0]`: only images given by "
     "`image_url` (a URL or data URL) can be translated; `file_id` refers to a file stored on "
     "OpenAI's servers"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type",
     "`input[0].content[0]`: content part type 'input_file' has no chat-completions equivalent"),
])
def test_untranslatable_requests_name_their_param(request_body, param, words):
    with pytest.raises(Untranslatable) as caught:
        to_chat(request_body)
    assert caught.value.param == param
    assert words in caught.value.message
    error = json.loads(ERRORS.body(untranslatable(caught.value)))["error"]
    assert error["param"] == param and caught.value.message in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("request_body", "dropped"), [
    ({"input": "x", "max_tool_calls": 2}, {"max_tool_calls": 1}),
    ({"input": "x", "tools": [TOOL, {"type": "web_search"}]}, {"hosted_tool": 1}),
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]},
     {"hosted_tool": 1}),
    ({"input": "x", "tools": [{"type": "namespace", "name": "agents", "tools": [TOOL]},
                              {"type": "custom", "name": "apply_patch"}]},
     {"hosted_tool": 2}),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, {"tool_choice": 1}),
    ({"input": "x", "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
     {"tool_choice": 1}),
    ({"input": [{"type": "web_search_call", "id": "ws", "status": "completed"}]},
     {"unknown_block": 1}),
    # An item's own type decides, whatever else it carries.
    ({"input": [{"type": "web_search_call", "id": "ws", "role": "assistant"}]},
     {"unknown_block": 1}),
    ({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "a"}, {"type": "summary_text", "text": "s"}]}]},
     {"unknown_block": 1}),
    ({"input": "x", "store": False, "include": ["reasoning.encrypted_content"],
      "prompt_cache_key": "k", "client_metadata": {"a": "b"}, "text": {"verbosity": "low"},
      "reasoning": {"effort": "minimal", "summary": "auto"}, "brand_new": True},
     {"store": 1, "include": 1, "prompt_cache_key": 1, "metadata": 1, "verbosity": 1,
      "effort": 1, "reasoning_summary": 1, "other": 1}),
    ({"input": [{"type": "reasoning", "id": "rs", "summary": [
        {"type": "summary_text", "text": "s"}], "encrypted_content": "gAAA"}]},
     {"encrypted_reasoning": 1, "reasoning_summary": 1}),
    ({"input": "x", "reasoning": {"generate_summary": "auto"}}, {"reasoning_summary": 1}),
    ({"input": "x", "include": ["a", "message.output_text.logprobs", "b"]}, {"include": 2}),
    ({"input": "x", "text": {"format": {"type": "text"}, "verbosity": "low"}},
     {"verbosity": 1}),
    ({"input": "x", "tool_choice": {"type": "function", "name": "lookup"}}, {"tool_choice": 1}),
])
def test_what_has_no_chat_form_is_dropped_and_counted(request_body, dropped):
    drops = Dropped()
    chat = to_chat(request_body, dropped=drops)
    assert drops.counts == dropped
    assert "tool_choice" not in chat
    assert all(t["type"] == "function" for t in chat.get("tools", ()))


def test_custom_tool_calls_and_output_images_translate():
    chat = to_chat({"input": [
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch",
         "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "done"},
        {"type": "function_call", "call_id": "c2", "name": "view_image", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": [
            {"type": "input_text", "text": "here"},
            {"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]})
    assert chat["messages"] == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "apply_patch",
                                                          "arguments": "*** Begin Patch"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c2", "type": "function", "function": {"name": "view_image",
                                                          "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "here"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64,AA"}}]}]


@pytest.mark.parametrize(("reasoning", "flavor", "options", "dropped"), [
    ({"effort": "high"}, "vllm", {"reasoning_effort": "high"}, {}),
    ({"effort": "none"}, "vllm", {"chat_template_kwargs": {"enable_thinking": False}}, {}),
    ({"effort": "none"}, "openai", {}, {"thinking": 1}),  # "none" is no effort to drop
])
def test_reasoning_effort_becomes_the_engines_reasoning_options(reasoning, flavor, options,
                                                                dropped):
    drops = Dropped()
    chat = to_chat({"input": "x", "reasoning": reasoning}, flavor=flavor, dropped=drops)
    assert {k: chat[k] for k in ("reasoning_effort", "chat_template_kwargs")
            if k in chat} == options
    assert drops.counts == dropped


# ---- whole replies -----------------------------------------------------------------------


def test_whole_reply_with_reasoning_text_tool_calls_and_usage():
    request = {"model": "gpt-x", "input": "x", "tools": [TOOL], "instructions": "I"}
    reply = chat_reply("Let me look.", reasoning="Need data.",
                       calls=[("c1", "lookup", '{"q":"a"}'), ("c2", "lookup", '{"q":"b"}')],
                       finish="tool_calls", usage=USAGE)
    response = Response.model_validate(from_chat(reply, request, response_id="resp_9"))
    assert response.id == "resp_9" and response.status == "completed"
    assert response.model == "gpt-x" and response.instructions == "I"
    assert [item.type for item in response.output] == [
        "reasoning", "message", "function_call", "function_call"]
    assert response.output[0].content[0].text == "Need data."
    assert response.output_text == "Let me look."
    assert [(c.call_id, c.name, c.arguments) for c in response.output[2:]] == [
        ("c1", "lookup", '{"q":"a"}'), ("c2", "lookup", '{"q":"b"}')]
    assert response.usage.input_tokens == 11 and response.usage.output_tokens == 7
    assert response.usage.total_tokens == 18
    assert response.usage.input_tokens_details.cached_tokens == 4
    assert response.usage.output_tokens_details.reasoning_tokens == 3
    assert response.tools[0].name == "lookup"


def test_whole_reply_cut_by_length_is_incomplete():
    response = Response.model_validate(
        from_chat(chat_reply("Once upon", finish="length"), {"input": "x"}))
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[-1].status == "incomplete"


def test_logprobs_only_when_the_client_asked():
    entries = [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105],
                "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}]}]
    reply = chat_reply("Hi", logprobs={"content": entries})
    asked = {"input": "x", "include": ["message.output_text.logprobs"]}
    part = Response.model_validate(from_chat(reply, asked)).output[0].content[0]
    assert [(lp.token, lp.logprob, lp.bytes) for lp in part.logprobs] == [("Hi", -0.1, [72, 105])]
    assert from_chat(reply, {"input": "x"})["output"][0]["content"][0]["logprobs"] == []


@pytest.mark.parametrize("chat", [{}, {"choices": []}, {"choices": [{"message": None}]},
                                  {"choices": "x", "usage": 5}, [], None])
def test_malformed_replies_still_give_a_valid_response(chat):
    response = Response.model_validate(from_chat(chat, {"input": "x"}))
    assert response.output_text == "" and response.usage is None


# ---- streams -----------------------------------------------------------------------------


def test_first_text_delta_leaves_with_the_first_content_chunk():
    translator = StreamTranslator({"input": "x"}, response_id="resp_s")
    first = decode_events(translator.feed(stream_chunks("Hello there")[0]))
    assert [e["type"] for e in first] == ["response.created", "response.in_progress"]
    second = decode_events(translator.feed(stream_chunks("Hello there")[1]))
    assert second[-1]["type"] == "response.output_text.delta"
    assert second[-1]["delta"] == "Hell"


def test_stream_events_are_sequenced_and_arguments_stream_as_they_come():
    request = {"model": "gpt-x", "input": "x", "tools": [TOOL]}
    calls = [("c1", "lookup", '{"q":"alpha"}'), ("c2", "lookup", '{"q":"beta"}')]
    events = run_stream(request, stream_chunks("Sure.", reasoning="Hmm.", calls=calls,
                                               finish="tool_calls", usage=USAGE))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    arg_deltas = [(e["output_index"], e["delta"]) for e in events
                  if e["type"] == "response.function_call_arguments.delta"]
    assert len(arg_deltas) == 6 and "".join(d for i, d in arg_deltas if i == 2) == calls[0][2]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == ["reasoning", "message", "function_call",
                                         "function_call"]
    final = events[-1]
    assert final["type"] == "response.completed"
    assert final["response"]["usage"]["total_tokens"] == 18
    reply = chat_reply("Sure.", reasoning="Hmm.", calls=calls, finish="tool_calls",
                       usage=USAGE)
    assert final["response"] == from_chat(reply, request, response_id="resp_t")
    sdk = sdk_final(request, events)
    assert sdk.output_text == "Sure."
    assert [(o.call_id, o.arguments) for o in sdk.output if o.type == "function_call"] == [
        ("c1", calls[0][2]), ("c2", calls[1][2])]


def test_stream_without_content_gets_an_empty_message_and_length_is_incomplete():
    events = run_stream({"input": "x"}, stream_chunks(None, finish="length"))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"] == from_chat(chat_reply(None, finish="length"),
                                               {"input": "x"}, response_id="resp_t")
    assert events[-1]["response"]["output"][0]["status"] == "incomplete"


@pytest.mark.parametrize(("finish", "final"), [("length", "response.incomplete"),
                                               ("stop", "response.completed")])
def test_text_in_the_chunk_that_carries_finish_reason_reaches_the_client(finish, final):
    """vLLM sends the last text with finish_reason on ``length`` and stop-string endings.
    Kills the translator dropping (or not translating) the text of the chunk that carries
    finish_reason."""
    chunks = finish_on_last_chunk(stream_chunks("Hello there", finish=finish, usage=USAGE))
    ending = chunks[-2]["choices"][0]
    assert ending["delta"]["content"] and ending["finish_reason"] == finish
    events = run_stream({"input": "x"}, chunks)
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas[-1] == ending["delta"]["content"] and "".join(deltas) == "Hello there"
    assert events[-1]["type"] == final
    assert events[-1]["response"] == from_chat(
        chat_reply("Hello there", finish=finish, usage=USAGE), {"input": "x"},
        response_id="resp_t")
    if final == "response.completed":
        assert sdk_final({"input": "x"}, events).output_text == "Hello there"


def test_stream_tool_name_after_id_and_no_name_at_all():
    chunks = [
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c9"}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": '{"a"'}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"name": "f", "arguments": ":1}"}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 1, "function": {"arguments": "{}"}}]}, "finish_reason": "tool_calls"}]},
    ]
    events = run_stream({"input": "x"}, chunks)
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [(i["call_id"], i["name"]) for i in added] == [("c9", "f"), ("call_t_1", "")]
    final = events[-1]["response"]["output"]
    assert [(i["name"], i["arguments"]) for i in final] == [("f", '{"a":1}'), ("", "{}")]
    assert [i["status"] for i in final] == ["completed", "completed"]
    assert_done_events_say_what_the_final_response_holds(events)


def test_reasoning_after_text_closes_the_message_and_each_item_completes():
    """Items follow the chat stream's order, whatever it is: text, reasoning, text again
    (a change of kind closes the open item, completed), then two tool calls."""
    request = {"input": "x", "tools": [TOOL]}
    delta = [{"content": "a"}, {"reasoning_content": "b"}, {"content": "c"},
             {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "lookup",
                                                                  "arguments": "{}"}}]},
             {"tool_calls": [{"index": 1, "id": "c2", "function": {"name": "lookup",
                                                                  "arguments": "[]"}}]}]
    chunks = stream_chunks(None, finish="tool_calls")
    chunks[1:1] = [{**chunks[0], "choices": [{"index": 0, "delta": d, "finish_reason": None}]}
                   for d in delta]
    events = run_stream(request, chunks)
    final = events[-1]["response"]["output"]
    assert [(i["type"], i["status"]) for i in final] == [
        ("message", "completed"), ("reasoning", "completed"), ("message", "completed"),
        ("function_call", "completed"), ("function_call", "completed")]
    assert_done_events_say_what_the_final_response_holds(events)
    assert [o.type for o in sdk_final(request, events).output] == [i["type"] for i in final]


def _with_logprobs(content: str | None, *tokens: tuple[str, float]) -> dict:
    """A content chunk (``content`` None: a delta without it) and its chat logprobs."""
    chunk = stream_chunks("x", pieces=1)[1]
    chunk["choices"][0]["delta"] = {} if content is None else {"content": content}
    chunk["choices"][0]["logprobs"] = {"content": [
        {"token": t, "logprob": lp, "bytes": list(t.encode()),
         "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}]}
        for t, lp in tokens]}
    return chunk


@pytest.mark.parametrize("asked", [True, False], ids=["asked", "not-asked"])
def test_streamed_logprobs_reach_the_client_with_their_delta_only_when_asked(asked):
    """Each token's logprob goes out with its text delta, a token whose text is empty (a
    character cut between tokens) included; a chunk without content adds no delta. Not
    asked for: the client gets no logprobs, and no delta for the empty token."""
    request = {"input": "x", **({"include": ["message.output_text.logprobs"]} if asked else {})}
    tokens = [("Hi", -0.5), ("", -1.0), ("!", -0.25)]
    role, *_, stop = stream_chunks("x")
    chunks = [role, _with_logprobs("Hi", tokens[0]), _with_logprobs("", tokens[1]),
              _with_logprobs(None), _with_logprobs("!", tokens[2]), stop]
    events = run_stream(request, chunks)
    deltas = [(e["delta"], e["logprobs"]) for e in events
              if e["type"] == "response.output_text.delta"]
    sent = [(t, [{"token": t, "logprob": lp, "top_logprobs": [{"token": t, "logprob": lp}]}])
            for t, lp in tokens]
    assert deltas == (sent if asked else [("Hi", []), ("!", [])])
    every = [e for c in chunks[1:-1] for e in c["choices"][0]["logprobs"]["content"]]
    whole = from_chat(chat_reply("Hi!", logprobs={"content": every}), request,
                      response_id="resp_t")
    assert events[-1]["response"] == whole
    assert len(whole["output"][0]["content"][0]["logprobs"]) == (3 if asked else 0)
    assert_done_events_say_what_the_final_response_holds(events)
    assert sdk_final(request, events).output_text == "Hi!"


def test_upstream_error_chunk_and_error_event_end_the_stream():
    translator = StreamTranslator({"input": "x"})
    first = translator.feed(stream_chunks("Hi")[1])
    broken = translator.feed({"error": {"message": "engine died", "code": 500}})
    events = decode_events([*first, *broken])
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert {k: v for k, v in events[-2].items() if k != "sequence_number"} == {
        "type": "error", "message": "engine died", "code": "server_error", "param": None}
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"] == {"code": "server_error",
                                               "message": "engine died"}
    assert events[-1]["response"]["output"] == []  # the open message never completed
    assert translator.feed(stream_chunks("Hi")[1]) == [] and translator.finish() == []
    assert translator.error_event("again") == b""
    fresh = StreamTranslator({"input": "x"})
    assert decode_events([fresh.error_event("cut")])[2]["message"] == "cut"


# ---- property tests ----------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=12)
ITEM_KEYS = ["type", "role", "content", "call_id", "name", "arguments", "output", "text",
             "image_url", "summary", "id", "input", "encrypted_content"]
ITEM = st.dictionaries(st.sampled_from(ITEM_KEYS),
                       JSON | st.sampled_from(["message", "function_call", "reasoning",
                                               "function_call_output", "user", "assistant",
                                               "input_text", "input_image", "developer",
                                               "custom_tool_call",
                                               "custom_tool_call_output"]), max_size=5)
REQUEST = st.fixed_dictionaries({}, optional={
    "model": JSON | st.text(max_size=5), "input": st.lists(ITEM, max_size=4) | JSON,
    "instructions": JSON, "tools": st.lists(JSON | st.just(TOOL), max_size=2) | JSON,
    "tool_choice": JSON, "text": JSON, "reasoning": JSON, "include": JSON,
    "top_logprobs": JSON, "max_output_tokens": JSON, "stream": JSON, "temperature": JSON,
    "previous_response_id": JSON, "store": JSON, "client_metadata": JSON,
})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(REQUEST, JSON))
def test_to_chat_raises_only_untranslatable(request_body):
    try:
        chat = to_chat(request_body, dropped=Dropped(), flavor="vllm")
    except Untranslatable as exc:
        assert isinstance(exc.message, str) and exc.message
        return
    msgspec.json.encode(chat)  # whatever comes out is sendable JSON
    assert isinstance(chat["messages"], list)


WORD = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
ARGS = st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=4), max_size=3)


@settings(max_examples=150, deadline=None)
@given(text=st.none() | WORD, reasoning=st.none() | WORD,
       calls=st.lists(st.tuples(st.text("abc", min_size=1, max_size=3), ARGS), max_size=3),
       finish=st.sampled_from(["stop", "length", "tool_calls", None]),
       usage=st.none() | st.just(USAGE), pieces=st.integers(1, 5), attached=st.booleans())
def test_stream_joins_to_the_whole_reply_translation(text, reasoning, calls, finish, usage,
                                                     pieces, attached):
    """``attached``: finish_reason on the last chunk with a delta, as vLLM sends it."""
    request = {"model": "gpt-x", "input": "x", "tools": [TOOL]}
    calls = [(f"call_{i}", name, json.dumps(args)) for i, (name, args) in enumerate(calls)]
    chunks = stream_chunks(text, reasoning, calls, finish, usage, pieces)
    events = run_stream(request, finish_on_last_chunk(chunks) if attached else chunks)
    whole = from_chat(chat_reply(text, reasoning, calls, finish, usage), request,
                      response_id="resp_t")
    assert events[-1]["response"] == whole
    Response.model_validate(whole)
    assert_done_events_say_what_the_final_response_holds(events)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == (text or "")
    if events[-1]["type"] == "response.completed":
        assert sdk_final(request, events).output_text == (text or "")


# ---- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(("status", "body", "message", "kind", "code"), [
    (400, b'{"error":{"message":"bad","type":"BadRequestError","param":"x","code":400}}',
     "bad", "BadRequestError", "400"),
    (400, b'{"object":"error","message":"too long","type":"BadRequestError","code":400}',
     "too long", "BadRequestError", "400"),
    (422, b'{"detail":[{"loc":["body"],"msg":"field required"}]}',
     '[{"loc":["body"],"msg":"field required"}]', "invalid_request_error", None),
    (502, b"<html>Bad Gateway</html>", "<html>Bad Gateway</html>", "server_error", None),
    (500, b"", "upstream error (HTTP 500)", "server_error", None),
])
def test_error_from_chat(status, body, message, kind, code):
    error = json.loads(error_from_chat(status, body))["error"]
    assert (error["message"], error["type"], error["code"]) == (message, kind, code)


@given(st.integers(100, 599), st.binary(max_size=64) | JSON.map(msgspec.json.encode))
def test_error_from_chat_never_raises(status, body):
    assert isinstance(json.loads(error_from_chat(status, body))["error"]["message"], str)


# ---- end to end with the openai SDK -------------------------------------------------------


@pytest.fixture
def via_engine(engine, serve_app):
    """A translating server in front of the mock engine; returns (client, sent requests)."""
    sent: list[dict] = []
    url = serve_app(translating_app(api, engine.base_url, sent=sent,
                                    model_map=lambda name: "mock-model"))
    return openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0), sent


def test_sdk_stream_and_create_agree_through_the_mock_engine(via_engine):
    client, sent = via_engine
    kwargs = {"model": "gpt-x", "instructions": "Use tools.", "input": "Go.",
              "tools": [TOOL]}
    with client.responses.stream(**kwargs) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        streamed = stream.get_final_response()
    whole = client.responses.create(**kwargs)
    assert sent[0]["model"] == "mock-model" and sent[0]["stream"] is True
    call = next(o for o in streamed.output if o.type == "function_call")
    # The arguments follow TOOL's schema (an optional string "q"), the same both ways.
    arguments = json.loads(call.arguments)
    assert call.name == "lookup" and set(arguments) <= {"q"}
    assert all(type(v) is str for v in arguments.values())
    assert call.arguments == next(o for o in whole.output if o.type == "function_call").arguments
    assert "".join(deltas) == call.arguments and len(deltas) > 1
    assert streamed.usage.total_tokens > 0 and streamed.model == "gpt-x"
    strip = {"id": True, "created_at": True, "output": {"__all__": {"id", "parsed_arguments"}}}
    assert streamed.model_dump(exclude=strip) == whole.model_dump(exclude=strip)


def test_sdk_sees_untranslatable_and_upstream_errors_in_openai_shape(via_engine, serve_app):
    client, _ = via_engine
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="m", input=[
            {"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}])
    assert caught.value.body["param"] == "input[0].content[0].type"
    failing = serve_app(scripted_chat_app((503, b'{"error":{"message":"overloaded"}}')))
    client = openai.OpenAI(base_url=serve_app(translating_app(api, failing)) + "/v1",
                           api_key="k", max_retries=0)
    with pytest.raises(openai.InternalServerError, match="overloaded"):
        client.responses.create(model="m", input="x")


def test_sdk_stream_with_reasoning_and_parallel_calls(serve_app):
    calls = [("c1", "lookup", '{"q":"a"}'), ("c2", "lookup", '{"q":"b"}')]
    upstream = serve_app(scripted_chat_app(stream_chunks(
        "Two lookups.", reasoning="Plan it.", calls=calls, finish="tool_calls", usage=USAGE)))
    client = openai.OpenAI(base_url=serve_app(translating_app(api, upstream)) + "/v1",
                           api_key="k", max_retries=0)
    with client.responses.stream(model="m", input="x", tools=[TOOL]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text == "Plan it."
    assert final.output_text == "Two lookups."
    assert [(o.call_id, o.arguments) for o in final.output[2:]] == [
        (c, a) for c, _, a in calls]
    assert final.usage.input_tokens == 11


# ---- a multi-turn tool conversation, the chat way and the Responses way ------------------


def test_tool_round_trip_sends_what_a_chat_harness_sends(engine):
    """A Responses client resending its whole history each turn gives the engine the same
    messages, hence the same prompt tokens, as a chat-completions harness."""
    chat_tools = [{"type": "function", "function": {
        "name": TOOL["name"], "description": TOOL["description"],
        "parameters": TOOL["parameters"]}}]


    harness = [{"role": "system", "content": "Be useful."},
               {"role": "user", "content": "Plan a trip."}]
    items: list[dict] = [{"role": "user", "content": "Plan a trip."}]
    turns = 0
    while True:
        translated = to_chat({"model": "m", "instructions": "Be useful.", "input": items,
                              "tools": [TOOL]})
        assert translated["messages"] == harness
        assert tok.apply_chat_template(translated["messages"], translated["tools"]) == (
            tok.apply_chat_template(harness, chat_tools))
        reply = engine_chat(engine.url, {"model": "m", "messages": harness, "tools": chat_tools})
        assert engine_chat(engine.url, translated)["choices"] == reply["choices"]
        message = reply["choices"][0]["message"]
        harness.append(harness_turn(message))
        response = from_chat(reply, {"model": "m", "input": items, "tools": [TOOL]})
        items += response["output"]
        if not message.get("tool_calls"):
            break
        for call in message["tool_calls"]:
            harness.append({"role": "tool", "tool_call_id": call["id"], "content": "done"})
            items.append({"type": "function_call_output", "call_id": call["id"],
                          "output": "done"})
        turns += 1
    assert turns == 2  # the mock engine calls a tool twice, then answers


def test_history_parts_arguments_and_reasoning_join_as_chat_needs_them():
    """Refusals and plain text parts are text; arguments sent as an object are JSON text,
    missing ones empty; reasoning parts join, and reasoning before a call goes to the
    assistant turn the call opens."""
    chat = to_chat({"input": [
        {"role": "user", "content": [{"type": "text", "text": "Go."}]},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "a"},
                                          {"type": "summary_text", "text": "s"},
                                          {"type": "reasoning_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": {"q": 1}},
        {"type": "function_call", "call_id": "c2", "name": "g"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "c"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "d"}]},
        {"role": "assistant", "content": "Done."},
    ]})
    assert chat["messages"] == [
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": None, "reasoning_content": "ab", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"q":1}'}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "assistant", "content": "No.", "reasoning_content": "c"},
        {"role": "assistant", "content": "Done.", "reasoning_content": "d"},
    ]
    with pytest.raises(Untranslatable) as caught:
        to_chat({"model": "m"})
    assert caught.value.message == "`input` is required (the whole conversation, resent each turn)"


# ---- the response object -----------------------------------------------------------------


def test_the_response_echoes_the_request_and_counts_usage_and_items_as_the_api_does():
    request = {"input": "x", "metadata": {"k": "v"}, "max_output_tokens": 50, "tools": [TOOL]}
    uncached = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}
    reply = chat_reply("Hi", reasoning="Hm", calls=[("c1", "lookup", "{}"), ("c2", "lookup", "{}")],
                       finish="content_filter", usage=uncached)
    response = from_chat(reply, request, response_id="resp_9")
    assert (response["status"], response["incomplete_details"]) == (
        "incomplete", {"reason": "content_filter"})
    assert (response["background"], response["error"]) == (False, None)
    assert (response["metadata"], response["max_output_tokens"]) == ({"k": "v"}, 50)
    assert response["usage"] == {
        "input_tokens": 11, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 18}
    assert [item["id"] for item in response["output"]] == ["rs_9_0", "msg_9_1", "fc_9_2", "fc_9_3"]
    Response.model_validate(response)


def test_logprob_entries_are_kept_only_with_a_token_and_a_number_and_keep_their_bytes():
    """What an engine may send besides well-formed entries is left out, entry by entry;
    a token's own bytes (a character cut between tokens) win over its text's."""
    cut = {"token": "\ufffd", "logprob": -0.5, "bytes": [226, 130]}
    entries = [
        {"token": None, "logprob": -1.0}, {"token": "a", "logprob": True},
        {**cut, "top_logprobs": [cut, {"token": None, "logprob": -1.0},
                                 {"token": "b", "logprob": "x"}, "junk"]},
        {"token": "é", "logprob": -0.25, "bytes": None, "top_logprobs": None},
        {"token": "o", "logprob": -0.75, "bytes": ["o"]},
    ]
    asked = {"input": "x", "include": ["message.output_text.logprobs"]}
    part = from_chat(chat_reply("\ufffdéo", logprobs={"content": entries}), asked)[
        "output"][0]["content"][0]
    assert part["logprobs"] == [
        {**cut, "top_logprobs": [cut]},
        {"token": "é", "logprob": -0.25, "bytes": [195, 169], "top_logprobs": []},
        {"token": "o", "logprob": -0.75, "bytes": [111], "top_logprobs": []}]


def test_the_response_echoes_each_setting_in_its_own_type_and_defaults_the_rest():
    """Settings are echoed as the client sent them; a value of the wrong type (a bool where
    a number goes, an effort the API does not know, a tool that is not a function) is
    echoed as the API's default, never as what was sent."""
    lookup = {**TOOL, "strict": True}
    echoed = from_chat(chat_reply("Hi"), {
        "input": "x", "model": "m1", "instructions": "Be brief.", "parallel_tool_calls": False,
        "reasoning": {"effort": "minimal", "summary": "concise"}, "temperature": 0.5,
        "top_p": 1, "user": "u1", "text": {"format": {"type": "json_object"}},
        "tool_choice": {"type": "function", "name": "lookup", "extra": 1},
        "tools": [lookup, {"type": "web_search"}, {"type": "function", "name": 5}, "junk"]},
        response_id="resp_e")
    assert {k: echoed[k] for k in ("id", "object", "created_at", "model", "instructions",
                                   "parallel_tool_calls", "reasoning", "temperature", "top_p",
                                   "user", "text", "tool_choice", "tools")} == {
        "id": "resp_e", "object": "response", "created_at": 1700000000, "model": "m1",
        "instructions": "Be brief.", "parallel_tool_calls": False,
        "reasoning": {"effort": "minimal", "summary": "concise"}, "temperature": 0.5,
        "top_p": 1, "user": "u1", "text": {"format": {"type": "json_object"}},
        "tool_choice": {"type": "function", "name": "lookup"},
        "tools": [{"type": "function", "name": "lookup", "description": "Look a thing up",
                   "parameters": TOOL["parameters"], "strict": True}]}
    assert (echoed["max_tool_calls"], echoed["previous_response_id"], echoed["truncation"]) == (
        None, None, "disabled")
    odd = from_chat(chat_reply("Hi"), {
        "input": "x", "model": 7, "instructions": ["no"], "max_output_tokens": True,
        "parallel_tool_calls": "no", "reasoning": {"effort": "extreme", "summary": "long"},
        "temperature": True, "top_p": "1", "user": 5, "text": "plain", "metadata": ["k"],
        "tool_choice": {"type": "function"}, "tools": {"type": "function", "name": "f"}})
    assert {k: odd[k] for k in ("model", "instructions", "max_output_tokens",
                                "parallel_tool_calls", "reasoning", "temperature", "top_p",
                                "user", "text", "metadata", "tool_choice", "tools")} == {
        "model": "", "instructions": None, "max_output_tokens": None,
        "parallel_tool_calls": True, "reasoning": {"effort": None, "summary": None},
        "temperature": None, "top_p": None, "user": None, "text": {"format": {"type": "text"}},
        "metadata": {}, "tool_choice": "auto", "tools": []}
    for effort in ("none", "low", "medium", "high"):
        assert from_chat(chat_reply("Hi"), {"input": "x", "reasoning": {"effort": effort}})[
            "reasoning"] == {"effort": effort, "summary": None}
    for summary in ("auto", "detailed"):
        assert from_chat(chat_reply("Hi"), {"input": "x", "reasoning": {"summary": summary}})[
            "reasoning"] == {"effort": None, "summary": summary}
    for choice in ("none", "required", "auto"):
        assert from_chat(chat_reply("Hi"), {"input": "x", "tool_choice": choice})[
            "tool_choice"] == choice
    bare = from_chat(chat_reply("Hi"), {"input": "x", "reasoning": "high", "tool_choice": "any"})
    assert (bare["reasoning"], bare["tool_choice"], bare["parallel_tool_calls"]) == (
        None, "auto", True)
    Response.model_validate(echoed)
    Response.model_validate(odd)
