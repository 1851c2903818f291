"""How a translated stream starts and ends, for both APIs: the start comes first even
when the first chunk already carries reasoning or usage; a chat stream with nothing before
``[DONE]`` still gives a whole, well-formed event stream (its start included); the end is
said once; and nothing follows it, not even an error for a connection lost afterwards.

The translators' events in general are defended in test_translate_responses.py and
test_translate_messages.py (Hypothesis streams, the SDKs' own stream accumulators).
"""

from __future__ import annotations

import json

import pytest
from helpers.chat_upstreams import CHAT_USAGE, stream_chunks

from tracetap.proxy.apis.messages import translate as messages
from tracetap.proxy.apis.responses import translate as responses

REQUESTS = {messages: {"model": "m", "max_tokens": 8, "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]},
            responses: {"model": "m", "input": "hi", "stream": True}}


def _names(events: list[bytes]) -> list[str]:
    return [e.split(b"\n", 1)[0].removeprefix(b"event: ").decode() for e in events]


def _payload(event: bytes) -> dict:
    return json.loads(event.split(b"\ndata: ", 1)[1])


def test_an_empty_messages_stream_still_starts_and_stops_the_message():
    events = messages.StreamTranslator(REQUESTS[messages]).finish()
    assert _names(events) == ["message_start", "message_delta", "message_stop"]
    message = _payload(events[0])["message"]
    assert message["content"] == [] and message["id"].startswith("msg_")
    # No usage reported: nothing is made up.
    assert message["usage"] == {"input_tokens": 0, "output_tokens": 0}


def test_an_empty_responses_stream_still_creates_and_completes_the_response():
    events = responses.StreamTranslator(REQUESTS[responses]).finish()
    names = _names(events)
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "response.completed"
    # An empty message, so that a client always has an output item to read.
    assert [item["type"] for item in _payload(events[-1])["response"]["output"]] == ["message"]


@pytest.mark.parametrize("api", [messages, responses], ids=["messages", "responses"])
def test_the_end_is_said_once_and_nothing_follows_it(api):
    translator = api.StreamTranslator(REQUESTS[api])
    assert translator.finish()
    assert translator.finish() == []
    assert translator.error_event("connection lost") == b""
    assert translator.feed({"id": "c", "object": "chat.completion.chunk", "created": 1,
                            "model": "m", "choices": [{"index": 0, "delta": {"content": "x"},
                                                       "finish_reason": None}]}) == []


@pytest.mark.parametrize("api", [messages, responses], ids=["messages", "responses"])
def test_after_an_error_the_stream_does_not_also_end_normally(api):
    translator = api.StreamTranslator(REQUESTS[api])
    assert translator.error_event("upstream stream ended early")
    assert translator.finish() == []
    assert translator.error_event("again") == b""


@pytest.mark.parametrize("api", [messages, responses], ids=["messages", "responses"])
@pytest.mark.parametrize("request_body", [None, [], "hi"])
def test_a_request_that_is_not_an_object_still_gets_a_whole_stream(api, request_body):
    events = api.StreamTranslator(request_body).finish()
    assert _names(events)[-1] in ("message_stop", "response.completed")


@pytest.mark.parametrize(("field", "delta"), [
    ("reasoning_content", {"type": "thinking_delta", "thinking": "Let me see."}),
    ("content", {"type": "text_delta", "text": "Let me see."})], ids=["reasoning", "text"])
def test_a_first_chunk_with_text_comes_after_the_message_start(field, delta):
    first = stream_chunks(text="ok", pieces=1)[0]
    first["choices"][0]["delta"][field] = "Let me see."  # the role and text in one chunk
    events = messages.StreamTranslator(REQUESTS[messages]).feed(first)
    assert _names(events) == ["message_start", "content_block_start", "content_block_delta"]
    assert _payload(events[2])["delta"] == delta


UNCACHED = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}


@pytest.mark.parametrize(("usage", "input_tokens"), [(CHAT_USAGE, 11 - 4), (UNCACHED, 11)],
                         ids=["cached", "uncached"])
def test_usage_in_the_first_chunk_is_in_the_message_start(usage, input_tokens):
    """Servers that report usage in every chunk (vLLM's continuous usage stats): the
    message_start already has the uncached input tokens, and no output yet."""
    first = {**stream_chunks(text="ok", pieces=1)[0], "usage": usage}
    (start,) = messages.StreamTranslator(REQUESTS[messages]).feed(first)
    assert _payload(start)["message"]["usage"] == {"input_tokens": input_tokens,
                                                   "output_tokens": 0}


@pytest.mark.parametrize("delta", [
    {"reasoning_content": "Let me see."}, {"content": "Let me see."},
    {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{}"}},
                    {"index": 1, "id": "c2", "function": {"name": "g", "arguments": "[]"}}]},
], ids=["reasoning", "text", "two-tool-calls"])
def test_a_first_chunk_with_content_comes_after_the_response_start(delta):
    """The first chunk carries content (and usage, as vLLM's continuous usage stats send
    it): the start still comes first, in progress and without usage, and every delta of
    the chunk follows it."""
    first = {**stream_chunks(text="ok", pieces=1)[0], "usage": CHAT_USAGE}
    first["choices"][0]["delta"] = delta
    translator = responses.StreamTranslator(REQUESTS[responses])
    events = translator.feed(first)
    assert _names(events)[:2] == ["response.created", "response.in_progress"]
    for event in events[:2]:
        response = _payload(event)["response"]
        assert (response["status"], response["usage"], response["output"]) == (
            "in_progress", None, [])
        assert response["id"].startswith("resp_") and response["created_at"] == 1700000000
    added = [_payload(e)["item"]["type"] for e in events
             if _names([e]) == ["response.output_item.added"]]
    assert added == {"reasoning_content": ["reasoning"], "content": ["message"],
                     "tool_calls": ["function_call"] * 2}[next(iter(delta))]


def test_chunks_without_created_start_the_response_once():
    """A chunk need not carry ``created``: the response is still created once, with one
    ``created_at`` for every event."""
    translator = responses.StreamTranslator(REQUESTS[responses])
    chunks = stream_chunks(text="Hello there", usage=CHAT_USAGE)
    events = [e for c in chunks for e in translator.feed(
        {k: v for k, v in c.items() if k != "created"})] + translator.finish()
    names = _names(events)
    assert names.count("response.created") == 1 and names.count("response.in_progress") == 1
    stamps = {_payload(e)["response"]["created_at"] for e in events if b'"response"' in e}
    assert len(stamps) == 1 and all(isinstance(s, int) for s in stamps)
