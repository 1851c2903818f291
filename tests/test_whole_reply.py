"""A whole (non-stream) reply through the in-process proxy: translated for a client of
another API (``relay.whole_reply``, ``ModelCall.reply_body``), an upstream's error
translated into the client's error shape, a reply that is not JSON relayed as it came
with a note on the record, and an upstream that breaks mid-body answered with a clear
502 (``relay.broken_error``)."""

from __future__ import annotations

import asyncio
import json
import threading

import anthropic
import openai
import pytest
from aiohttp import web
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.proxy.runtime.settings import Settings

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def start(loop_thread, tmp_path, migrated_sqlite):
    """Factory: a proxy (SQLite: nothing here depends on the database) to ``upstream``."""
    started: list[Proxy] = []

    def start(upstream: str) -> Proxy:
        db = migrated_sqlite(tmp_path / f"p{len(started)}.db")
        settings = Settings(
            upstream=upstream,
            db=db,
            data_dir=str(tmp_path / f"d{len(started)}"),
            port=free_port(),
            upstream_flavor="vllm",
        )
        started.append(Proxy(loop_thread, settings).start())
        return started[-1]

    yield start
    for proxy in started:
        proxy.stop()


def _anthropic(proxy: Proxy, episode: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=f"{proxy.url}/episodes/{episode}", api_key="x", max_retries=0
    )


def _upstream(serve_app, handler) -> str:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    return serve_app(app) + "/v1"


def test_a_translated_whole_reply_is_the_engines_answer_in_the_clients_api(engine, start):
    """A Messages client over a chat engine: the reply is a Message carrying the chat
    reply's text, stop reason and usage (kills the translation given nothing, or not
    given the chat reply or the client's request)."""
    proxy = start(engine.url)
    with _anthropic(proxy, "whole") as agent:
        got = agent.messages.create(model="mock-model", max_tokens=64, messages=MESSAGES)
    [call] = proxy.calls("whole")
    [choice] = call["choices"]
    assert got.type == "message" and got.role == "assistant"
    assert [(b.type, b.text) for b in got.content] == [("text", choice["text"])]
    assert choice["text"] and got.stop_reason == "end_turn" and got.model == "mock-model"
    assert got.usage.output_tokens == call["completion_tokens"] > 0
    assert call["status"] == "ok" and call["error"] is None


def test_an_upstream_error_reaches_a_translated_client_in_its_own_shape(serve_app, start):
    """The chat upstream's 400 becomes an Anthropic error with the upstream's message
    (kills the body not translated, or translated from nothing)."""

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "error": {
                    "message": "context too long for this model",
                    "type": "BadRequestError",
                    "param": "messages",
                    "code": 400,
                }
            },
            status=400,
        )

    proxy = start(_upstream(serve_app, refuse))
    with _anthropic(proxy, "refused") as agent, pytest.raises(anthropic.BadRequestError) as err:
        agent.messages.create(model="m", max_tokens=16, messages=MESSAGES)
    body = err.value.body
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "context too long for this model" in body["error"]["message"]
    [call] = proxy.calls("refused")
    assert call["http_status"] == 400


def test_a_translated_reply_that_is_not_json_is_relayed_with_a_note(serve_app, start):
    """An upstream that answers 200 with something that is not JSON: the client gets the
    bytes as they came, and the record says why they were not translated."""

    async def garbage(request: web.Request) -> web.Response:
        return web.Response(body=b"<html>not json</html>", content_type="application/json")

    proxy = start(_upstream(serve_app, garbage))
    with _anthropic(proxy, "garbage") as agent:
        raw = agent.messages.with_raw_response.create(model="m", max_tokens=16, messages=MESSAGES)
    assert raw.http_response.content == b"<html>not json</html>"
    [call] = proxy.calls("garbage")
    assert call["error"] == "upstream reply is not JSON: relayed as it came"


def test_an_upstream_that_breaks_mid_body_is_a_clear_502(engine, start):
    """The client's own error shape: type ``upstream_error`` and a message that says the
    upstream failed mid-reply; the call is stored as an upstream error."""
    proxy = start(engine.url)
    client = openai.OpenAI(base_url=proxy.episode_url("trunc"), api_key="x", max_retries=0)
    with client, pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(
            model="mock-model", messages=MESSAGES, extra_body={"mock_fail_after_chunks": 1}
        )
    assert info.value.status_code == 502
    error = info.value.body if "message" in info.value.body else info.value.body["error"]
    assert error["type"] == "upstream_error" and error["code"] == "upstream_error"
    # ... and how: aiohttp's error, as described.
    assert error["message"].startswith("upstream failed mid-reply: ClientPayloadError: ")
    [call] = proxy.calls("trunc")
    assert call["status"] == "upstream_error" and call["http_status"] == 502
    assert call["error"] == error["message"]


class StallsFirst:
    """A chat upstream whose first reply sends its headers and half its body, then
    stalls (until the proxy cuts it); later replies come whole."""

    def __init__(self):
        self.requests = 0
        self.bodies: list[bytes] = []  # each request's body, as the upstream got it
        self.stalled = threading.Event()
        self._resent: asyncio.Event | None = None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.read())
        self.requests += 1
        if self._resent is None:
            self._resent = asyncio.Event()
        body = json.dumps(
            {
                "id": f"r{self.requests}",
                "object": "chat.completion",
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": f"answer {self.requests}"},
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
            }
        ).encode()
        if self.requests > 1:
            self._resent.set()
            return web.Response(body=body, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = len(body)
        await response.prepare(request)
        await response.write(body[: len(body) // 2])
        self.stalled.set()
        # Stalled until the request comes again (the proxy cut this one long before).
        await asyncio.wait_for(self._resent.wait(), 60)
        return response


def test_a_body_cut_mid_read_by_a_weight_sync_is_sent_again(serve_app, start):
    """The weight sync comes while the reply's body is being read (its headers are in):
    the request is sent again after the resume and the client gets the second answer;
    the cut attempt is stored apart (kills the driver's resend not handed to the read)."""
    upstream = StallsFirst()
    proxy = start(_upstream(serve_app, upstream.chat))
    assert proxy.admin("PUT", "/tracetap/policy", {"version": "v1"})[0] == 200
    answers: list[str] = []
    client = openai.OpenAI(base_url=proxy.episode_url("midbody"), api_key="x", max_retries=0)

    def call() -> None:
        reply = client.chat.completions.create(model="m", messages=MESSAGES)
        answers.append(reply.choices[0].message.content)

    with client:
        worker = threading.Thread(target=call)
        worker.start()
        assert upstream.stalled.wait(30)
        status, paused = proxy.admin("POST", "/tracetap/pause", {"mode": "abort", "timeout": 10})
        assert status == 200 and paused["drained"] is True
        assert proxy.admin("POST", "/tracetap/resume", {"policy_version": "v2"})[0] == 200
        worker.join(30)
    assert answers == ["answer 2"] and upstream.requests == 2
    first, resent = upstream.bodies  # the same request again, body and all
    assert resent == first and json.loads(first)["messages"] == MESSAGES
    stored = sorted((c["status"], c["policy_version"]) for c in proxy.calls("midbody"))
    assert stored == [("ok", "v2"), ("weight_sync_retried", "v1")]
