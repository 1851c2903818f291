"""Anthropic Messages API ⇄ chat completions: requests, whole replies, streams and errors,
checked against the real ``anthropic`` SDK types and stream parser."""

from __future__ import annotations

import json

import anthropic
import msgspec
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from helpers.chat_upstreams import CHAT_USAGE as USAGE
from helpers.chat_upstreams import chat_reply, scripted_chat_app, stream_chunks, translating_app
from helpers.translation import decode_named_events, engine_chat, finish_on_last_chunk, harness_turn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from tracetap.demo import tokenizer as tok
from tracetap.proxy.apis.dropped import Dropped
from tracetap.proxy.apis.messages import translate as api
from tracetap.proxy.apis.messages.translate import (
    ERRORS,
    StreamTranslator,
    Untranslatable,
    error_from_chat,
    from_chat,
    to_chat,
    untranslatable,
)

EVENTS = TypeAdapter(RawMessageStreamEvent)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=12)
TOOL = {"name": "lookup", "description": "Look a thing up",
        "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}
BASE = {"model": "claude-x", "max_tokens": 64}


def decode_events(raw: list[bytes]) -> list[dict]:
    """SSE bytes → event payloads; each must be a valid Messages stream event."""
    return decode_named_events(raw, lambda p: p["type"] == "error" or EVENTS.validate_python(p))


def run_stream(request: dict, chunks: list[dict], response_id="msg_t") -> list[dict]:
    translator = StreamTranslator(request, response_id=response_id)
    raw = [event for c in chunks for event in translator.feed(c)] + translator.finish()
    return decode_events(raw)


def sdk_final(events: list[dict]) -> Message:
    """The anthropic SDK's own stream accumulator over our events."""
    snapshot, buffers = None, {}
    for payload in events:
        snapshot = accumulate_event(event=EVENTS.validate_python(payload),
                                    current_snapshot=snapshot, json_bufs=buffers)
    return Message.model_validate(snapshot.model_dump())


# ---- requests ----------------------------------------------------------------------------


def test_system_blocks_messages_and_sampling():
    chat = to_chat({**BASE, "system": [
        {"type": "text", "text": "You are a CLI.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Be terse."}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "<reminder>"}, {"type": "text", "text": "List files."},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}]}],
        "temperature": 0.5, "top_p": 0.9, "top_k": 20, "stop_sequences": ["END"],
        "metadata": {"user_id": "u"}, "thinking": {"type": "enabled", "budget_tokens": 1024},
        "service_tier": "auto",
        # what Anthropic's coding CLI sends by default: a no-op without server-side state
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }, model_map=lambda name: "qwen3-8b")
    assert chat == {
        "model": "qwen3-8b",
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "You are a CLI."},
                                           {"type": "text", "text": "Be terse."}]},
            {"role": "user", "content": [
                {"type": "text", "text": "<reminder>"}, {"type": "text", "text": "List files."},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
        "max_tokens": 64, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "stop": ["END"]}


def test_tools_tool_choice_and_stream_options():
    chat = to_chat({**BASE, "messages": [{"role": "user", "content": "x"}], "stream": True,
                    "tools": [TOOL, {**TOOL, "name": "other", "type": "custom",
                                     "cache_control": {"type": "ephemeral"}}],
                    "tool_choice": {"type": "tool", "name": "lookup",
                                    "disable_parallel_tool_use": True}})
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "lookup", "description": "Look a thing up",
                                          "parameters": TOOL["input_schema"]}},
        {"type": "function", "function": {"name": "other", "description": "Look a thing up",
                                          "parameters": TOOL["input_schema"]}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}
    assert chat["parallel_tool_calls"] is False
    assert chat["stream_options"] == {"include_usage": True}
    for anthropic_choice, chat_choice in (("auto", "auto"), ("any", "required"),
                                          ("none", "none")):
        translated = to_chat({**BASE, "messages": [], "tools": [TOOL],
                              "tool_choice": {"type": anthropic_choice}})
        assert translated["tool_choice"] == chat_choice
    # vLLM refuses a tool_choice without tools: none left, none sent.
    assert "tool_choice" not in to_chat({**BASE, "messages": [], "tool_choice": {"type": "auto"}})


def test_history_tool_use_and_results_become_tool_calls_and_tool_messages():
    chat = to_chat({**BASE, "messages": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Two cities.", "signature": "sig"},
            {"type": "redacted_thinking", "data": "EncryptedBlob"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": "Paris"}},
            {"type": "tool_use", "id": "t2", "name": "lookup", "input": {"q": "Rome", "n": 1}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
             "content": [{"type": "text", "text": "rain"}]},
            {"type": "text", "text": "And tomorrow?"}]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t3", "name": "lookup", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t3"}]},
    ]})
    assert chat["messages"] == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Two cities.",
         "tool_calls": [
             {"id": "t1", "type": "function", "function": {"name": "lookup",
                                                           "arguments": '{"q":"Paris"}'}},
             {"id": "t2", "type": "function", "function": {"name": "lookup",
                                                           "arguments": '{"q":"Rome","n":1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "t2", "content": "rain"},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t3", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t3", "content": ""},
    ]
    assert "continue_final_message" not in chat


def test_final_assistant_turn_is_a_prefill():
    chat = to_chat({**BASE, "messages": [{"role": "user", "content": "Count"},
                                         {"role": "assistant", "content": "1, 2,"}]})
    assert chat["messages"][-1] == {"role": "assistant", "content": "1, 2,"}
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False


@pytest.mark.parametrize(("request_body", "param", "words"), [
    ({**BASE, "messages": [], "mcp_servers": [{"type": "url", "url": "http://x",
                                               "name": "m"}]}, "mcp_servers", "MCP"),
    ({**BASE, "messages": [], "container": "c1"}, "container", "container"),
    ({**BASE, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                        "data": "JVBER"}}]}]},
     "messages[0].content[0].source.type", "PDF"),
    ({**BASE, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     "messages[0].content[0].source.type", "file"),
    ({**BASE, "messages": [{"role": "assistant", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/i.png"}}]}]},
     "messages[0].content[0].type", "user messages"),
    ({**BASE, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role",
     "user, assistant or system"),
    ({**BASE, "messages": [], "system": [{"type": "image"}]}, "system[0].type",
     "user messages"),
    ({**BASE, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "not an object"}]}]},
     "messages[0].content[0].input", "object"),
    ({"model": "m"}, "messages", "array"),
    ({**BASE, "messages": [], "max_tokens": "lots"}, "max_tokens", "integer"),
    # Each malformed field is named in full, in its param and its message.
    ("hi", None, "the request body must be a JSON object"),
    ({**BASE, "messages": ["hi"]}, "messages[0]", "`messages[0]` must be a JSON object"),
    ({**BASE, "messages": [], "system": 5}, "system", "`system` must be an array"),
    ({**BASE, "messages": [], "system": ["S"]}, "system[0]",
     "`system[0]` must be a JSON object"),
    ({**BASE, "messages": [{"role": "system", "content": 5}]}, "messages[0].content",
     "`messages[0].content` must be an array"),
    *(({**BASE, "messages": [{"role": role, "content": 5}]}, "messages[0].content",
       "`messages[0].content` must be a string or an array of content blocks")
      for role in ("user", "assistant")),
    *(({**BASE, "messages": [{"role": role, "content": ["x"]}]}, "messages[0].content[0]",
       "`messages[0].content[0]` must be a JSON object") for role in ("user", "assistant")),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text", "`messages[0].content[0].text` must be a string"),
    ({**BASE, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": 5}]}]},
     "messages[0].content[0].tool_use_id", "`messages[0].content[0].tool_use_id` must be"),
    ({**BASE, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": 5}]}]},
     "messages[0].content[0].content",
     "`messages[0].content[0].content` must be a string or an array of content blocks"),
    ({**BASE, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": ["x"]}]}]},
     "messages[0].content[0].content[0]",
     "`messages[0].content[0].content[0]` must be a JSON object"),
    ({**BASE, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": 5}]}]}]},
     "messages[0].content[0].content[0].text",
     "`messages[0].content[0].content[0].text` must be a string"),
    *(({**BASE, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}, key: 5}]}]},
       f"messages[0].content[0].{key}", f"`messages[0].content[0].{key}` must be a string")
      for key in ("id", "name")),
    ({**BASE, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]},
     "messages[0].content[0].input", "`messages[0].content[0].input` must be a JSON object"),
    ({**BASE, "messages": [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": 5}]}]},
     "messages[0].content[0].thinking", "`messages[0].content[0].thinking` must be a string"),
    *(({**BASE, "messages": [{"role": "user", "content": [{"type": kind, "source": "x"}]}]},
       "messages[0].content[0].source", "`messages[0].content[0].source` must be a JSON object")
      for kind in ("image", "document")),
    *(({**BASE, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": kind, "media_type": "image/png", "data": "AAAA", "url": "http://x", key: 5}}]}]},
       f"messages[0].content[0].source.{key}",
       f"`messages[0].content[0].source.{key}` must be a string")
      for kind, key in (("base64", "media_type"), ("base64", "data"), ("url", "url"))),
    ({**BASE, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     "messages[0].content[0].source.type", "`messages[0].content[0].source`: image source "
     "'file' cannot be translated (only base64 and url; a file id refers to Anthropic's file "
     "storage)"),
    ({**BASE, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "data": 5}}]}]},
     "messages[0].content[0].source.data", "`messages[0].content[0].source.data` must be"),
    *(({**BASE, "messages": [{"role": "user", "content": [
        {"type": "document", "source": source}]}]},
       "messages[0].content[0].source.type", "`messages[0].content[0]`: only plain-text "
       "documents can be translated (a PDF or a file id has no chat-completions form)")
      for source in ({"type": "file", "file_id": "f"},
                     {"type": "content", "content": [{"type": "text", "text": 5}]},
                     {"type": "base64", "media_type": "application/pdf", "data": "JVBER",
                      "content": [{"type": "text", "text": "not the document"}]})),
    ({**BASE, "messages": [], "tools": TOOL}, "tools", "`tools` must be an array"),
    ({**BASE, "messages": [], "tools": ["x"]}, "tools[0]", "`tools[0]` must be a JSON object"),
    ({**BASE, "messages": [], "tools": [{**TOOL, "name": 5}]}, "tools[0].name",
     "`tools[0].name` must be a string"),
    ({**BASE, "messages": [], "tool_choice": "auto"}, "tool_choice",
     "`tool_choice` must be a JSON object"),
    ({**BASE, "messages": [], "tools": [TOOL], "tool_choice": {"type": "tool", "name": 5}},
     "tool_choice.name", "`tool_choice.name` must be a string"),
    ({**BASE, "messages": [], "stop_sequences": "END"}, "stop_sequences",
     "`stop_sequences` must be an array"),
    ({**BASE, "messages": [], "stop_sequences": ["END", 5]}, "stop_sequences[1]",
     "`stop_sequences[1]` must be a string"),
    ({**BASE, "messages": [], "output_config": "x"}, "output_config",
     "`output_config` must be a JSON object"),
    ({**BASE, "messages": [], "output_format": "json"}, "output_format",
     "`output_format` must be a JSON object"),
    ({**BASE, "messages": [], "output_format": {"type": "json_object"}}, "output_format.type",
     "`output_format.type` must be json_schema"),
    ({**BASE, "messages": [], "output_format": {"type": "json_schema"}}, "output_format.schema",
     "`output_format.schema` must be a JSON object"),
    ({**BASE, "messages": [], "output_config": {"format": {"type": "text"}}},
     "output_config.format.type", "`output_config.format.type` must be json_schema"),
])
def test_untranslatable_requests_name_their_param(request_body, param, words):
    with pytest.raises(Untranslatable) as caught:
        to_chat(request_body)
    assert caught.value.param == param
    assert words in caught.value.message
    body = ErrorResponse.model_validate_json(ERRORS.body(untranslatable(caught.value)))
    assert body.error.type == "invalid_request_error"
    assert caught.value.message in body.error.message


@pytest.mark.parametrize(("request_body", "dropped", "kept"), [
    ({**BASE, "messages": [], "tools": [TOOL, {"type": "web_search_20250305",
                                               "name": "web_search"}]},
     {"hosted_tool": 1}, {"tools": [{"type": "function", "function": {
         "name": "lookup", "description": "Look a thing up",
         "parameters": TOOL["input_schema"]}}]}),
    ({**BASE, "messages": [], "tools": [{"type": "bash_20250124", "name": "bash"}],
      "tool_choice": {"type": "tool", "name": "bash"}},
     {"hosted_tool": 1, "tool_choice": 1}, {}),
    ({**BASE, "messages": [{"role": "assistant", "content": [
        {"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}},
        {"type": "text", "text": "Found it."}]}]},
     {"unknown_block": 1}, {"messages": [{"role": "assistant", "content": "Found it."}]}),
    ({**BASE, "messages": [{"role": "user", "content": [
        {"type": "web_search_tool_result", "tool_use_id": "s", "content": []},
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]},
     {"unknown_block": 1, "cache_control": 1},
     {"messages": [{"role": "user", "content": "hi"}]}),
    ({**BASE, "messages": [], "tool_choice": {"type": "sometimes"}}, {"tool_choice": 1}, {}),
    ({**BASE, "messages": [{"role": "user", "content": "hi"}], "metadata": {"user_id": "u"},
      "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
      "service_tier": "auto", "brand_new_field": 1},
     {"metadata": 1, "context_management": 1, "service_tier": 1, "other": 1}, {}),
    ({**BASE, "messages": [], "thinking": {"type": "enabled", "budget_tokens": 2048},
      "output_config": {"effort": "max"}}, {"thinking": 1, "effort": 1}, {}),
    ({**BASE, "messages": [], "tool_choice": {"type": "tool", "name": "lookup"}},
     {"tool_choice": 1}, {}),
    ({**BASE, "messages": [], "thinking": "on"}, {"thinking": 1}, {}),
    ({**BASE, "messages": [], "thinking": {"type": "sometimes"}}, {"thinking": 1}, {}),
])
def test_what_has_no_chat_form_is_dropped_and_counted(request_body, dropped, kept):
    drops = Dropped()
    chat = to_chat(request_body, dropped=drops)
    assert drops.counts == dropped
    assert {k: chat[k] for k in kept} == kept
    assert "tool_choice" not in chat or request_body.get("tool_choice", {}).get("type") in (
        "auto", "any", "none")


def test_system_turns_among_messages_stay_in_place():
    """Claude Code 2.1 sends system-role turns after the user's (agent lists, reminders)."""
    chat = to_chat({**BASE, "system": "S", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": [{"type": "text", "text": "Agents: a, b",
                                        "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": "ok"},
        {"role": "system", "content": "more"},
        {"role": "user", "content": "go"}]})
    assert chat["messages"] == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
        {"role": "system", "content": "Agents: a, b"}, {"role": "assistant", "content": "ok"},
        {"role": "system", "content": "more"}, {"role": "user", "content": "go"}]


def test_text_documents_are_text_and_tool_result_images_follow_as_the_users():
    chat = to_chat({**BASE, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "is_error": False, "content": [
            {"type": "text", "text": "a picture:"},
            {"type": "image", "source": {"type": "url", "url": "http://x/i.png"}}]},
        {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                        "data": "notes"}}]}]})
    assert chat["messages"] == [
        {"role": "tool", "tool_call_id": "t", "content": "a picture:"},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/i.png"}},
            {"type": "text", "text": "notes"}]}]


def test_text_before_a_tool_result_thinking_blocks_strict_tools_and_what_each_drops():
    """A user's text before a tool result stays before it; thinking blocks join in order;
    signatures, redacted thinking and citations are counted; ``strict`` is kept."""
    drops = Dropped()
    chat = to_chat({**BASE, "tools": [{**TOOL, "strict": True}], "messages": [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "One.", "signature": "sig"},
            {"type": "thinking", "thinking": "Two.", "signature": ""},
            {"type": "redacted_thinking", "data": "blob"},
            {"type": "tool_use", "id": "t1", "name": "lookup", "input": {}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "Before.", "citations": [{"type": "char_location"}]},
            {"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "done"},
                {"type": "image", "source": {"type": "url", "url": "http://x/i.png"}}]},
            {"type": "text", "text": "After."}]}]}, dropped=drops)
    assert chat["messages"] == [
        {"role": "assistant", "content": None, "reasoning_content": "One.\n\nTwo.",
         "tool_calls": [{"id": "t1", "type": "function",
                         "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "user", "content": "Before."},
        {"role": "tool", "tool_call_id": "t1", "content": "done"},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/i.png"}},
            {"type": "text", "text": "After."}]}]
    assert chat["tools"][0]["function"]["strict"] is True
    assert drops.counts == {"encrypted_reasoning": 2, "citations": 1}


def test_structured_output_and_content_documents_translate():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    wanted = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    chat = to_chat({**BASE, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "content", "content": [
            {"type": "text", "text": "a"}, "junk", {"type": "text", "text": "b"}]}}]}],
        "output_format": {"type": "json_schema", "schema": schema}})
    assert chat["response_format"] == wanted
    assert chat["messages"] == [{"role": "user", "content": "a\n\nb"}]
    drops = Dropped()
    chat = to_chat({**BASE, "messages": [], "output_config": {
        "format": {"type": "json_schema", "schema": schema}, "effort": "high",
        "task_budget": {"total": 100}}}, dropped=drops, flavor="vllm")
    assert (chat["response_format"], chat["reasoning_effort"]) == (wanted, "high")
    assert drops.counts == {"other": 1}


@pytest.mark.parametrize(("settings_", "flavor", "options", "dropped"), [
    ({"output_config": {"effort": "low"}}, "vllm", {"reasoning_effort": "low"}, {}),
    ({"thinking": {"type": "adaptive"}}, "vllm", {}, {}),
    ({"thinking": {"type": "disabled"}}, "vllm",
     {"chat_template_kwargs": {"enable_thinking": False}}, {}),
    ({"thinking": {"type": "disabled"}}, "sglang",
     {"chat_template_kwargs": {"enable_thinking": False}}, {}),
    ({"thinking": {"type": "disabled"}}, "openai", {}, {"thinking": 1}),
    ({"thinking": {"type": "disabled"}}, "llamacpp", {}, {"thinking": 1}),
])
def test_thinking_and_effort_become_the_engines_reasoning_options(settings_, flavor,
                                                                  options, dropped):
    drops = Dropped()
    chat = to_chat({**BASE, "messages": [], **settings_}, dropped=drops, flavor=flavor)
    assert {k: chat[k] for k in ("reasoning_effort", "chat_template_kwargs")
            if k in chat} == options
    assert drops.counts == dropped


# ---- whole replies -----------------------------------------------------------------------


def test_whole_reply_with_thinking_text_tool_use_and_usage():
    reply = chat_reply("Let me look.", reasoning="Need data.",
                       calls=[("c1", "lookup", '{"q": "a"}'), ("c2", "lookup", "")],
                       finish="tool_calls", usage=USAGE)
    message = Message.model_validate(from_chat(reply, {**BASE, "messages": []},
                                               response_id="msg_9"))
    assert message.id == "msg_9" and message.model == "claude-x"
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert message.content[0].thinking == "Need data."
    assert message.content[1].text == "Let me look."
    assert [(b.id, b.input) for b in message.content[2:]] == [("c1", {"q": "a"}), ("c2", {})]
    assert message.stop_reason == "tool_use"
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens,
            message.usage.output_tokens) == (7, 4, 7)


@pytest.mark.parametrize(("finish", "stop_reason", "stops", "reason", "sequence"), [
    ("stop", None, None, "end_turn", None),
    ("stop", "END", ["END"], "stop_sequence", "END"),
    ("stop", 151645, ["END"], "end_turn", None),  # vLLM: a stop token id, not a sequence
    ("length", None, None, "max_tokens", None),
    ("content_filter", None, None, "refusal", None),
    (None, None, None, "end_turn", None),
])
def test_stop_reasons(finish, stop_reason, stops, reason, sequence):
    request = {**BASE, "messages": [], **({"stop_sequences": stops} if stops else {})}
    message = Message.model_validate(from_chat(
        chat_reply("text", finish=finish, stop_reason=stop_reason), request))
    assert (message.stop_reason, message.stop_sequence) == (reason, sequence)


def test_tool_arguments_that_are_not_an_object_read_as_empty_input():
    reply = chat_reply(None, calls=[("c1", "f", "{broken"), ("c2", "f", "[1]")])
    message = Message.model_validate(from_chat(reply, BASE))
    assert [b.input for b in message.content] == [{}, {}]


@pytest.mark.parametrize("chat", [{}, {"choices": []}, {"choices": [{"message": 3}]}, None])
def test_malformed_replies_still_give_a_valid_message(chat):
    message = Message.model_validate(from_chat(chat, BASE))
    assert message.content == [] and message.stop_reason == "end_turn"


# ---- streams -----------------------------------------------------------------------------


def test_first_text_delta_leaves_with_the_first_content_chunk():
    translator = StreamTranslator(BASE, response_id="msg_s")
    chunks = stream_chunks("Hello there")
    assert [e["type"] for e in decode_events(translator.feed(chunks[0]))] == ["message_start"]
    second = decode_events(translator.feed(chunks[1]))
    assert [e["type"] for e in second] == ["content_block_start", "content_block_delta"]
    assert second[-1]["delta"] == {"type": "text_delta", "text": "Hell"}


def test_stream_blocks_tool_json_deltas_and_usage():
    request = {**BASE, "messages": [], "tools": [TOOL]}
    calls = [("c1", "lookup", '{"q":"alpha"}'), ("c2", "lookup", '{"q":"beta"}')]
    events = run_stream(request, stream_chunks("Sure.", reasoning="Hmm.", calls=calls,
                                               finish="tool_calls", usage=USAGE))
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use", "tool_use"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1, 2, 3]
    json_deltas = [(e["index"], e["delta"]["partial_json"]) for e in events
                   if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "input_json_delta"]
    assert len(json_deltas) == 6 and "".join(d for i, d in json_deltas if i == 3) == calls[1][2]
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    assert events[-2]["usage"] == {"input_tokens": 7, "output_tokens": 7,
                                   "cache_read_input_tokens": 4}
    reply = chat_reply("Sure.", reasoning="Hmm.", calls=calls, finish="tool_calls",
                       usage=USAGE)
    assert sdk_final(events) == Message.model_validate(from_chat(reply, request,
                                                                 response_id="msg_t"))


def test_stream_stop_sequence_from_the_finish_chunk():
    chunks = stream_chunks("abc")
    chunks[-1]["choices"][0]["stop_reason"] = "END"
    events = run_stream({**BASE, "stop_sequences": ["END"]}, chunks)
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


@pytest.mark.parametrize(("finish", "stop", "delta"), [
    ("length", None, {"stop_reason": "max_tokens", "stop_sequence": None}),
    ("stop", "END", {"stop_reason": "stop_sequence", "stop_sequence": "END"}),
], ids=["length", "stop-string"])
def test_text_in_the_chunk_that_carries_finish_reason_reaches_the_client(finish, stop, delta):
    """vLLM sends the last text with finish_reason on ``length`` and stop-string endings.
    Kills the translator dropping (or not translating) the text of the chunk that carries
    finish_reason."""
    chunks = stream_chunks("Hello there", finish=finish, usage=USAGE)
    chunks[-2]["choices"][0]["stop_reason"] = stop
    chunks = finish_on_last_chunk(chunks)
    ending = chunks[-2]["choices"][0]
    assert ending["delta"]["content"] and ending["finish_reason"] == finish
    events = run_stream({**BASE, "stop_sequences": ["END"]}, chunks)
    deltas = [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"]
    assert deltas[-1] == ending["delta"]["content"] and "".join(deltas) == "Hello there"
    assert events[-2]["delta"] == delta
    assert sdk_final(events).content[0].text == "Hello there"


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
    final = sdk_final(run_stream(BASE, chunks))
    assert [(b.id, b.name, b.input) for b in final.content] == [
        ("c9", "f", {"a": 1}), ("toolu_t_1", "", {})]


def test_upstream_error_chunk_and_error_event_end_the_stream():
    translator = StreamTranslator(BASE)
    first = translator.feed(stream_chunks("Hi")[1])
    broken = translator.feed({"error": {"message": "engine died", "code": 500}})
    events = decode_events([*first, *broken])
    assert events[-1] == {"type": "error", "error": {"type": "api_error",
                                                     "message": "engine died"}}
    ErrorResponse.model_validate(events[-1])
    assert translator.feed(stream_chunks("Hi")[1]) == [] and translator.finish() == []
    assert translator.error_event("again") == b""


# ---- property tests ----------------------------------------------------------------------

BLOCK_KEYS = ["type", "text", "id", "name", "input", "tool_use_id", "content", "thinking",
              "source", "is_error", "cache_control", "signature", "citations"]
BLOCK = st.dictionaries(st.sampled_from(BLOCK_KEYS),
                        JSON | st.sampled_from(["text", "tool_use", "tool_result", "thinking",
                                                "image", "redacted_thinking", "document",
                                                "server_tool_use"]), max_size=5)
TURN = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]) | JSON},
                             optional={"content": st.lists(BLOCK, max_size=3) | JSON})
REQUEST = st.fixed_dictionaries({}, optional={
    "model": JSON | st.text(max_size=5), "messages": st.lists(TURN, max_size=3) | JSON,
    "system": JSON | st.lists(BLOCK, max_size=2), "tools": st.lists(JSON | st.just(TOOL),
                                                                    max_size=2) | JSON,
    "tool_choice": JSON, "max_tokens": JSON, "stop_sequences": JSON, "stream": JSON,
    "top_k": JSON, "thinking": JSON, "output_format": JSON, "output_config": JSON,
    "context_management": JSON, "metadata": JSON,
})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(REQUEST, JSON))
def test_to_chat_raises_only_untranslatable(request_body):
    try:
        chat = to_chat(request_body, dropped=Dropped(), flavor="vllm")
    except Untranslatable as exc:
        assert isinstance(exc.message, str) and exc.message
        return
    msgspec.json.encode(chat)
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
    request = {**BASE, "messages": [], "tools": [TOOL]}
    calls = [(f"toolu_{i}", name, json.dumps(args)) for i, (name, args) in enumerate(calls)]
    chunks = stream_chunks(text, reasoning, calls, finish, usage, pieces)
    events = run_stream(request, finish_on_last_chunk(chunks) if attached else chunks)
    whole = from_chat(chat_reply(text, reasoning, calls, finish, usage), request,
                      response_id="msg_t")
    assert sdk_final(events) == Message.model_validate(whole)
    deltas = "".join(e["delta"].get("text", "") for e in events
                     if e["type"] == "content_block_delta")
    assert deltas == (text or "")


# ---- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(("status", "body", "kind", "message"), [
    (400, b'{"error":{"message":"too long","type":"BadRequestError","code":400}}',
     "invalid_request_error", "too long"),
    (401, b'{"error":{"message":"no key"}}', "authentication_error", "no key"),
    (404, b'{"object":"error","message":"no model m"}', "not_found_error", "no model m"),
    (422, b'{"detail":"bad field"}', "invalid_request_error", "bad field"),
    (429, b"slow down", "rate_limit_error", "slow down"),
    (500, b"", "api_error", "upstream error (HTTP 500)"),
    (503, b"<html>busy</html>", "overloaded_error", "<html>busy</html>"),
    (504, b"{}", "timeout_error", "{}"),
])
def test_error_from_chat(status, body, kind, message):
    error = ErrorResponse.model_validate_json(error_from_chat(status, body)).error
    assert (error.type, error.message) == (kind, message)


@given(st.integers(100, 599), st.binary(max_size=64) | JSON.map(msgspec.json.encode))
def test_error_from_chat_never_raises(status, body):
    ErrorResponse.model_validate_json(error_from_chat(status, body))


# ---- end to end with the anthropic SDK ----------------------------------------------------


@pytest.fixture
def via_engine(engine, serve_app):
    """A translating server in front of the mock engine; returns (client, sent requests)."""
    sent: list[dict] = []
    url = serve_app(translating_app(api, engine.base_url, sent=sent,
                                    model_map=lambda name: "mock-model"))
    return anthropic.Anthropic(base_url=url, api_key="k", max_retries=0), sent


def test_sdk_stream_and_create_agree_through_the_mock_engine(via_engine):
    client, sent = via_engine
    kwargs = {**BASE, "system": "Use tools.", "messages": [{"role": "user", "content": "Go."}],
              "tools": [TOOL]}
    with client.messages.stream(**kwargs) as stream:
        deltas = [e.delta.partial_json for e in stream
                  if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        streamed = stream.get_final_message()
    whole = client.messages.create(**kwargs)
    assert sent[0]["model"] == "mock-model" and sent[0]["stream"] is True
    call = next(b for b in streamed.content if b.type == "tool_use")
    # The arguments follow TOOL's schema (an optional string "q"), the same both ways.
    assert call.name == "lookup" and set(call.input) <= {"q"} and len(deltas) > 1
    assert all(type(v) is str for v in call.input.values())
    assert call.input == next(b for b in whole.content if b.type == "tool_use").input
    assert streamed.stop_reason == "tool_use" and streamed.usage.output_tokens > 0
    assert streamed.usage.input_tokens == whole.usage.input_tokens > 0
    assert streamed.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})


def test_sdk_sees_untranslatable_and_upstream_errors_in_anthropic_shape(via_engine, serve_app):
    client, _ = via_engine
    with pytest.raises(anthropic.BadRequestError, match="container"):
        client.messages.create(**BASE, messages=[{"role": "user", "content": "x"}],
                               extra_body={"container": "c1"})
    failing = serve_app(scripted_chat_app((429, b'{"error":{"message":"slow down"}}')))
    client = anthropic.Anthropic(base_url=serve_app(translating_app(api, failing)),
                                 api_key="k", max_retries=0)
    with pytest.raises(anthropic.RateLimitError, match="slow down"):
        client.messages.create(**BASE, messages=[{"role": "user", "content": "x"}])


def test_sdk_stream_with_thinking_and_parallel_calls(serve_app):
    calls = [("t1", "lookup", '{"q":"a"}'), ("t2", "lookup", '{"q":"b"}')]
    upstream = serve_app(scripted_chat_app(stream_chunks(
        "Two lookups.", reasoning="Plan it.", calls=calls, finish="tool_calls", usage=USAGE)))
    client = anthropic.Anthropic(base_url=serve_app(translating_app(api, upstream)),
                                 api_key="k", max_retries=0)
    with client.messages.stream(**BASE, messages=[{"role": "user", "content": "x"}],
                                tools=[TOOL]) as stream:
        texts = [e.text for e in stream if e.type == "text"]
        final = stream.get_final_message()
    assert "".join(texts) == "Two lookups."
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert final.content[0].thinking == "Plan it."
    assert [(b.id, b.input) for b in final.content[2:]] == [("t1", {"q": "a"}),
                                                            ("t2", {"q": "b"})]
    assert final.usage.input_tokens == 7 and final.usage.cache_read_input_tokens == 4


def test_sdk_stream_broken_upstream_raises(serve_app):
    chunks = [*stream_chunks("Hello")[:2], {"error": {"message": "engine died"}}]
    upstream = serve_app(scripted_chat_app(chunks))
    client = anthropic.Anthropic(base_url=serve_app(translating_app(api, upstream)),
                                 api_key="k", max_retries=0)
    with pytest.raises(anthropic.APIStatusError, match="engine died"), client.messages.stream(
            **BASE, messages=[{"role": "user", "content": "x"}]) as stream:
        stream.get_final_message()


# ---- a multi-turn tool conversation, the chat way and the Messages way -------------------


def test_tool_round_trip_sends_what_a_chat_harness_sends(engine):
    """A Messages client resending its history each turn gives the engine the same
    messages, hence the same prompt tokens, as a chat-completions harness."""
    chat_tools = [{"type": "function", "function": {
        "name": TOOL["name"], "description": TOOL["description"],
        "parameters": TOOL["input_schema"]}}]


    harness = [{"role": "system", "content": "Be useful."},
               {"role": "user", "content": "Plan a trip."}]
    turns: list[dict] = [{"role": "user", "content": "Plan a trip."}]
    rounds = 0
    base = {**BASE, "max_tokens": 256}  # room for a sentence and a call with arguments
    while True:
        request = {**base, "system": "Be useful.", "messages": turns, "tools": [TOOL]}
        translated = to_chat(request)
        assert translated["messages"] == harness
        assert tok.apply_chat_template(translated["messages"], translated["tools"]) == (
            tok.apply_chat_template(harness, chat_tools))
        reply = engine_chat(engine.url, {"model": "m", "messages": harness, "tools": chat_tools,
                          "max_tokens": base["max_tokens"]})
        assert engine_chat(engine.url, translated)["choices"] == reply["choices"]
        message = reply["choices"][0]["message"]
        harness.append(harness_turn(message))
        answer = Message.model_validate(from_chat(reply, request))
        turns.append({"role": "assistant",
                      "content": [b.model_dump(exclude_none=True) for b in answer.content]})
        if answer.stop_reason != "tool_use":
            break
        results = []
        for call in message["tool_calls"]:
            harness.append({"role": "tool", "tool_call_id": call["id"], "content": "done"})
            results.append({"type": "tool_result", "tool_use_id": call["id"],
                            "content": "done"})
        turns.append({"role": "user", "content": results})
        rounds += 1
    assert rounds == 2  # the mock engine calls a tool twice, then answers
