"""A translated whole reply and a translated error have the shape the client's own API
gives them: ids with the API's prefixes, tool calls with an id and a name even when the
upstream left them out, and error bodies with every field the SDKs read.

The stream translators are defended in test_translate_responses.py and
test_translate_messages.py; this file holds what those check only in passing.
"""

from __future__ import annotations

import json

import pytest
from helpers.chat_upstreams import chat_reply

from tracetap.proxy.apis.messages import translate as messages
from tracetap.proxy.apis.responses import translate as responses
from tracetap.proxy.apis.translate_errors import Untranslatable

UPSTREAM_ERROR = b'{"error":{"message":"bad","type":"BadRequestError","param":"x","code":400}}'


def _nameless_call_reply() -> dict:
    """A chat reply whose one tool call came without an id or a name (a lax server)."""
    reply = chat_reply(calls=[("call-up", "lookup", '{"q": "x"}')], finish="tool_calls")
    function_call = reply["choices"][0]["message"]["tool_calls"][0]
    function_call["id"] = None
    function_call["function"]["name"] = None
    return reply


# ---- Responses ----------------------------------------------------------------------------


def test_a_translated_response_has_a_response_id():
    response = responses.from_chat(chat_reply("hello"), {"model": "m", "input": "hi"})
    assert response["id"].startswith("resp_") and len(response["id"]) > len("resp_")
    assert response["object"] == "response"
    # The caller's own id wins (the proxy's call id, so the stored call and the reply agree).
    given = responses.from_chat(chat_reply("hello"), {"input": "hi"}, response_id="resp_mine")
    assert given["id"] == "resp_mine"


def test_a_tool_call_without_id_or_name_gets_an_id_of_its_item_and_an_empty_name():
    response = responses.from_chat(_nameless_call_reply(), {"input": "hi"})
    (call,) = [item for item in response["output"] if item["type"] == "function_call"]
    assert call["id"].startswith("fc_")
    assert call["call_id"] == "call_" + call["id"].removeprefix("fc_")
    assert call["name"] == ""
    assert call["arguments"] == '{"q": "x"}'


@pytest.mark.parametrize("request_body", [None, [], "input"])
def test_a_request_that_is_not_an_object_still_gets_a_response(request_body):
    """The reply is translated whatever the request was (it was forwarded upstream as
    given); nothing of the request is echoed."""
    response = responses.from_chat(chat_reply("hello"), request_body)
    assert response["object"] == "response" and response["model"] == ""
    assert response["output"][0]["content"][0]["text"] == "hello"


def test_an_upstream_error_keeps_its_param():
    error = json.loads(responses.error_from_chat(400, UPSTREAM_ERROR))["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == "x"


def test_an_untranslatable_request_is_an_unsupported_parameter_error():
    error = json.loads(responses.ERRORS.body(responses.untranslatable(
        Untranslatable("logprobs are not translated", "top_logprobs"))))["error"]
    assert error == {"message": "cannot translate this Responses request to chat completions: "
                                "logprobs are not translated",
                     "type": "invalid_request_error", "param": "top_logprobs",
                     "code": "unsupported_parameter"}


# ---- Messages -----------------------------------------------------------------------------


def test_a_translated_message_has_a_message_id():
    message = messages.from_chat(chat_reply("hello"), {"model": "m", "max_tokens": 8})
    assert message["id"].startswith("msg_") and len(message["id"]) > len("msg_")
    assert message["type"] == "message" and message["model"] == "m"


def test_the_engines_reasoning_is_a_thinking_block_without_a_signature():
    """The engine's reasoning is plain text: no signature is made up for it (a client
    sends the block back as it got it, and it is read back as text)."""
    message = messages.from_chat(chat_reply("answer", reasoning="let me think"),
                                 {"max_tokens": 8})
    assert message["content"][0] == {"type": "thinking", "thinking": "let me think",
                                     "signature": ""}
    assert message["content"][1] == {"type": "text", "text": "answer"}


def test_a_tool_use_without_id_or_name_gets_an_id_of_the_message_and_an_empty_name():
    message = messages.from_chat(_nameless_call_reply(), {"max_tokens": 8})
    (use,) = [block for block in message["content"] if block["type"] == "tool_use"]
    assert use["id"] == "toolu_" + message["id"].removeprefix("msg_") + "_0"
    assert use["name"] == "" and use["input"] == {"q": "x"}
    assert message["stop_reason"] == "tool_use"


@pytest.mark.parametrize("request_body", [None, [], "input"])
def test_a_messages_request_that_is_not_an_object_still_gets_a_message(request_body):
    message = messages.from_chat(chat_reply("hello"), request_body)
    assert message["type"] == "message" and message["model"] == ""
    assert message["content"] == [{"type": "text", "text": "hello"}]


MESSAGE_KEYS = {"id", "type", "role", "model", "content", "stop_reason", "stop_sequence",
                "usage"}


@pytest.mark.parametrize(("usage", "expected"), [
    (None, {"input_tokens": 0, "output_tokens": 0}),
    ({"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
     {"input_tokens": 11, "output_tokens": 7}),
    ({"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18,
      "prompt_tokens_details": {"cached_tokens": 4}},
     {"input_tokens": 7, "output_tokens": 7, "cache_read_input_tokens": 4}),
], ids=["none", "uncached", "cached"])
def test_a_messages_reply_counts_usage_as_anthropic_does(usage, expected):
    """No usage reported is zero, not made up; cache reads are counted apart."""
    message = messages.from_chat(chat_reply("hello", usage=usage), {"max_tokens": 8})
    assert message["usage"] == expected
    assert set(message) == MESSAGE_KEYS


@pytest.mark.parametrize(("finish", "calls", "stop_reason"), [
    ("length", [("c1", "lookup", '{"q": ')], "max_tokens"),  # a tool call cut short
    ("tool_calls", [("c1", "lookup", "{}")], "tool_use"),
    (None, [], "end_turn"),
    ("something_new", [], "end_turn"),
    ("content_filter", [], "refusal"),
])
def test_a_messages_reply_says_why_it_stopped(finish, calls, stop_reason):
    message = messages.from_chat(chat_reply("x", calls=calls, finish=finish), {"max_tokens": 8})
    assert (message["stop_reason"], message["stop_sequence"]) == (stop_reason, None)


def test_only_a_stop_ending_reads_as_a_stop_sequence():
    """vLLM names the matched stop string in stop_reason; a reply cut by length that
    names one anyway is still max_tokens."""
    request = {"max_tokens": 8, "stop_sequences": ["END"]}
    stopped = messages.from_chat(chat_reply("x", finish="stop", stop_reason="END"), request)
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "END")
    cut = messages.from_chat(chat_reply("x", finish="length", stop_reason="END"), request)
    assert (cut["stop_reason"], cut["stop_sequence"]) == ("max_tokens", None)


@pytest.mark.parametrize("model", [5, None, ["m"]])
def test_a_model_that_is_not_a_string_is_not_echoed(model):
    assert messages.from_chat(chat_reply("x"), {"model": model, "max_tokens": 8})["model"] == ""
