"""What the relay gives a translated client when the chat upstream's stream is not tidy.

A Messages or Responses client of a chat engine gets only its own API's events, written
by the translator (``Relay.event``): an SSE comment the engine sends (a keep-alive), or a
chunk that is not JSON, must not reach the client as bytes of their own, and the stream
around them must stay well formed. A Responses client that asked for logprobs gets them
from the chat chunks' logprobs.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from aiohttp import web
from helpers.chat_upstreams import stream_chunks
from helpers.http import fetch
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.proxy.runtime.settings import Settings

WORDS = ["Hello", " there", " friend"]
LOGPROBS = [-0.5, -0.25, -0.125]


def _chunks() -> list[dict]:
    """A chat stream whose content chunks carry logprobs, as vLLM writes them."""
    chunks = stream_chunks("".join(WORDS), pieces=3,
                           usage={"prompt_tokens": 4, "completion_tokens": 3,
                                  "total_tokens": 7})
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    for chunk, word, logprob in zip(content, WORDS, LOGPROBS, strict=True):
        chunk["choices"][0]["delta"]["content"] = word
        chunk["choices"][0]["logprobs"] = {"content": [
            {"token": word, "logprob": logprob, "bytes": list(word.encode()),
             "top_logprobs": [{"token": word, "logprob": logprob,
                               "bytes": list(word.encode())}]}]}
    return chunks


def _untidy_stream() -> list[bytes]:
    """The chunks with a keep-alive comment after the first and a broken chunk before the
    end, then [DONE]."""
    events = [b"data: " + json.dumps(c).encode() + b"\n\n" for c in _chunks()]
    events.insert(1, b": keep-alive\n\n")
    events.insert(-2, b'data: {"id": "chatcmpl-1", "choices": [\n\n')
    return [*events, b"data: [DONE]\n\n"]


@pytest.fixture
def translating_proxy(loop_thread, serve_app, migrated_sqlite, tmp_path):
    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        for event in _untidy_stream():
            await reply.write(event)
        await reply.write_eof()
        return reply

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    settings = Settings(upstream=serve_app(app) + "/v1",
                        db=migrated_sqlite(tmp_path / "tracetap.db"),
                        data_dir=str(tmp_path / "d"), port=free_port(), translate="all")
    proxy = Proxy(loop_thread, settings).start()
    yield proxy
    proxy.stop()


def _events(raw: bytes) -> list[tuple[str, dict]]:
    """Each event of a Messages or Responses stream as (event name, data); fails on
    anything that is not such an event."""
    events = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        lines = block.split("\n")
        assert len(lines) == 2, f"not an event: {block!r}"
        kind, data = lines
        assert kind.startswith("event: ") and data.startswith("data: "), block
        data = json.loads(data.removeprefix("data: "))
        assert data["type"] == kind.removeprefix("event: "), block
        events.append((data["type"], data))
    return events


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/messages", {"model": "m", "max_tokens": 8, "stream": True,
                      "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"model": "m", "input": "hi", "stream": True}),
], ids=["messages", "responses"])
def test_a_comment_and_a_broken_chunk_never_reach_a_translated_client(
        translating_proxy, path, body):
    status, raw = fetch("POST", f"{translating_proxy.url}/episodes/untidy{path}", body)
    assert status == 200
    events = _events(raw)  # every byte the client got is one of its API's events
    text = "".join(d["delta"].get("text", "") if path == "/v1/messages" else d["delta"]
                   for kind, d in events
                   if kind in ("content_block_delta", "response.output_text.delta"))
    assert text == "".join(WORDS)
    assert events[-1][0] in ("message_stop", "response.completed")
    [call] = translating_proxy.calls("untidy")
    assert call["choices"][0]["text"] == "".join(WORDS)
    assert "unparseable upstream data" in call["error"]  # capture noted the broken chunk


def test_a_translated_responses_stream_gives_the_logprobs_the_client_asked_for(
        translating_proxy):
    agent = openai.OpenAI(base_url=translating_proxy.episode_url("lp"), api_key="x",
                          max_retries=0)
    with agent:
        stream = agent.responses.create(model="m", input="hi", stream=True,
                                        include=["message.output_text.logprobs"],
                                        top_logprobs=1)
        deltas = [e for e in stream if e.type == "response.output_text.delta"]
    assert [d.delta for d in deltas] == WORDS
    assert [[lp.logprob for lp in d.logprobs] for d in deltas] == [[x] for x in LOGPROBS]


def test_a_translated_messages_stream_reads_as_the_anthropic_sdk_expects(translating_proxy):
    agent = anthropic.Anthropic(base_url=translating_proxy.url + "/episodes/sdk",
                                api_key="x", max_retries=0)
    with agent, agent.messages.stream(model="m", max_tokens=8,
                                      messages=[{"role": "user", "content": "hi"}]) as s:
        message = s.get_final_message()
    assert message.content[0].text == "".join(WORDS) and message.stop_reason == "end_turn"
