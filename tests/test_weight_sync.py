"""A weight sync loses no rollout: a pause in abort mode cuts the calls in
flight at the engine, holds them, and after the resume continues a stream token for
token (one answer, one stored completion with its version spans) or sends a body again
(the cut attempt stored apart, never trained). Real openai SDK, proxy and mock engine."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time

import msgspec
import openai
import pytest
from aiohttp import web
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.demo.engine import EngineConfig, make_engine_app
from tracetap.demo.engine_common import ABORTS
from tracetap.demo.tokenizer import EOS
from tracetap.proxy.runtime.settings import Settings
from tracetap.storage.engine import create_engine
from tracetap.storage.integrity import verdicts_of

CONTENT = "The quick brown fox jumps over the lazy dog, then rests by the river bank."
MESSAGES = [{"role": "user", "content": "tell me about the fox"}]


@pytest.fixture
def db_url(tmp_path, migrated_sqlite):
    return migrated_sqlite(tmp_path / "tracetap.db")  # one database kind: the logic is the proxy's


def _aborts(engine, expected: int = 0) -> int:
    """The engine's count of aborted requests, once it reaches ``expected`` (an engine
    sees an abort at its next write) or after 2 s."""
    deadline = time.monotonic() + 2
    while engine._runner.app[ABORTS].count < expected and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the engine's own counter
    return engine._runner.app[ABORTS].count


def _verdict(proxy, episode: str) -> tuple[str, dict]:
    """The episode's integrity verdict on the database path (storage.integrity)."""
    async def read():
        engine = create_engine(proxy.settings.db)
        try:
            return (await verdicts_of(engine, [episode]))[episode]
        finally:
            await engine.dispose()

    proxy.flush()
    found = asyncio.run(read())
    return found.integrity, found.causes


def _stored(proxy, episode: str) -> list[tuple]:
    proxy.flush()
    path = proxy.settings.db.removeprefix("sqlite:///")
    with sqlite3.connect(path) as db:
        return db.execute(
            "SELECT c.status, c.policy_version, ch.policy_spans, ch.choice_index "
            "FROM calls c LEFT JOIN choices ch ON ch.call_id = c.call_id "
            "WHERE c.episode_id = ? ORDER BY c.t_start, c.seq", (episode,)).fetchall()


def _streamed(client, act_at: int, act, delay: float = 0.03) -> str:
    """CONTENT streamed to ``client``, ``act()`` run once its ``act_at``-th chunk is in
    (the stream still open at the engine); the text the client got."""
    stream = client.chat.completions.create(
        model="mock-model", messages=MESSAGES, max_tokens=200, stream=True,
        extra_body={"mock_content": CONTENT, "mock_chunk_delay_s": delay})
    text = []
    for i, chunk in enumerate(stream):
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if i == act_at:
            act()
    return "".join(text)


def test_a_stream_cut_by_a_weight_sync_is_continued_token_for_token(proxy, engine):
    assert proxy.admin("PUT", "/tracetap/policy", {"version": "v1"})[0] == 200
    client = openai.OpenAI(base_url=proxy.episode_url("cut-stream"), api_key="x", max_retries=0)
    paused = []

    def weight_sync():
        # Answers once every call in flight is cut and held: nothing left to drain.
        status, answer = proxy.admin("POST", "/tracetap/pause", {"mode": "abort", "timeout": 10})
        assert status == 200 and answer["drained"] is True
        assert _aborts(engine, 1) == 1  # the engine saw its request aborted
        assert proxy.admin("POST", "/tracetap/resume", {"policy_version": "v2"})[0] == 200
        paused.append(answer)

    with client:
        text = _streamed(client, 12, weight_sync)
    assert paused
    assert text == CONTENT  # one uninterrupted answer
    [(status, version, spans, _)] = _stored(proxy, "cut-stream")
    assert status == "ok" and version == "v1"
    [call] = proxy.calls("cut-stream")
    [choice] = call["choices"]
    # Token for token: the partial ids plus the continuation's are the content's bytes.
    assert choice["completion_ids"] == [*CONTENT.encode(), EOS]
    # The continuation's logprobs join the partial's: one per token, so the turn trains.
    assert len(choice["completion_logprobs"]) == len(choice["completion_ids"])
    spans = json.loads(spans)
    assert [v for _, v in spans] == ["v1", "v2"] and 0 < spans[1][0] < len(CONTENT)


def test_a_body_cut_by_a_weight_sync_is_sent_again_and_the_cut_attempt_kept_apart(proxy, engine):
    assert proxy.admin("PUT", "/tracetap/policy", {"version": "v1"})[0] == 200
    client = openai.OpenAI(base_url=proxy.episode_url("cut-body"), api_key="x", max_retries=0)
    answers = []
    with client:
        def slow_call():
            reply = client.chat.completions.create(
                model="mock-model", messages=MESSAGES, max_tokens=200,
                extra_body={"mock_content": CONTENT, "mock_delay_s": 1.0})
            answers.append(reply.choices[0].message.content)

        worker = _abort_while_at_the_engine(proxy, slow_call)
        assert proxy.admin("POST", "/tracetap/resume", {"policy_version": "v2"})[0] == 200
        worker.join(30)
    assert answers == [CONTENT]
    assert _aborts(engine, 1) == 1  # the engine saw the first request go
    rows = _stored(proxy, "cut-body")
    assert sorted((s, v) for s, v, _, _ in rows) == [("ok", "v2"), ("weight_sync_retried", "v1")]
    retried = [r for r in rows if r[0] == "weight_sync_retried"]
    assert retried[0][3] is None  # no choice: nothing of it can be trained
    # The operator's weight sync resent the body: the episode's reward is still the agent's.
    assert _verdict(proxy, "cut-body") == ("clean", {})


@pytest.fixture
def impatient(loop_thread, proxy_settings):
    """A proxy whose cut calls wait at most 0.5 s for the resume (--pause-timeout)."""
    proxy = Proxy(loop_thread, msgspec.structs.replace(proxy_settings, pause_timeout=0.5)).start()
    yield proxy
    proxy.stop()


def test_a_body_cut_by_a_pause_that_outlasts_its_timeout_is_not_sent_again(impatient, engine):
    """Held past --pause-timeout (0.5 s here), the cut call gives up: the client gets an
    error and the engine never sees the request again while the weights are changing."""
    proxy = impatient
    client = openai.OpenAI(base_url=proxy.episode_url("outlasted"), api_key="x", max_retries=0)
    errors = []
    with client:
        def slow_call():
            try:
                client.chat.completions.create(
                    model="mock-model", messages=MESSAGES, max_tokens=200,
                    extra_body={"mock_content": CONTENT, "mock_delay_s": 1.0})
            except openai.APIStatusError as exc:
                errors.append(exc.status_code)

        worker = _abort_while_at_the_engine(proxy, slow_call)
        worker.join(30)  # the pause is never lifted while the call waits
        assert proxy.admin("POST", "/tracetap/resume", {})[0] == 200
    assert errors == [502]  # the upstream side failed, not the proxy
    assert _aborts(engine, 1) == 1  # the engine saw the first request go
    # Not sent again: no answer stored, only the cut attempt and the call's failure.
    assert sorted(s for s, _, _, _ in _stored(proxy, "outlasted")) == [
        "upstream_error", "weight_sync_retried"]


def test_a_drain_pause_cuts_nothing(proxy, engine):
    client = openai.OpenAI(base_url=proxy.episode_url("drain"), api_key="x", max_retries=0)
    def drain():
        assert proxy.admin("POST", "/tracetap/pause", {"wait": False})[0] == 200

    with client:
        text = _streamed(client, 5, drain, delay=0.01)
    assert text == CONTENT and _aborts(engine) == 0
    assert proxy.admin("POST", "/tracetap/resume", {})[0] == 200
    assert proxy.admin("POST", "/tracetap/pause", {"mode": "cut"})[0] == 400


def test_a_stream_that_cannot_continue_exactly_is_not_cut(proxy, engine):
    """A request with tools: a raw continuation would not be parsed into the tool call,
    so the abort leaves it to finish on the old weights (its tokens' versions marked)."""
    tools = [{"type": "function", "function": {
        "name": "search", "parameters": {"type": "object", "properties": {
            "q": {"type": "string"}}, "required": ["q"]}}}]
    assert proxy.admin("PUT", "/tracetap/policy", {"version": "v1"})[0] == 200
    client = openai.OpenAI(base_url=proxy.episode_url("tools"), api_key="x", max_retries=0)
    calls = []
    with client:
        stream = client.chat.completions.create(
            model="mock-model", messages=MESSAGES, tools=tools, stream=True,
            extra_body={"mock_chunk_delay_s": 0.1})
        for i, chunk in enumerate(stream):
            if chunk.choices and chunk.choices[0].delta.tool_calls:
                calls.extend(chunk.choices[0].delta.tool_calls)
            if i == 1:
                assert proxy.admin("POST", "/tracetap/pause",
                                   {"mode": "abort", "wait": False})[0] == 200
    assert calls and calls[0].function.name == "search"
    assert _aborts(engine) == 0
    assert proxy.admin("POST", "/tracetap/resume", {})[0] == 200
    [(status, _, spans, _)] = _stored(proxy, "tools")
    assert status == "ok" and [v for _, v in json.loads(spans)] == ["v1", None]


def _abort_while_at_the_engine(proxy, call) -> threading.Thread:
    """Start ``call`` in a thread and pause the proxy with ``abort`` once the call is at
    the engine; returns the thread (the pause is the caller's to lift)."""
    worker = threading.Thread(target=call)
    worker.start()
    deadline = time.monotonic() + 10
    while proxy.state.gate.inflight == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)  # polling the proxy's own counter for the call to be admitted
    time.sleep(0.2)  # the request is at the engine
    status, paused = proxy.admin("POST", "/tracetap/pause", {"mode": "abort", "timeout": 10})
    assert status == 200 and paused["drained"] is True
    return worker


@pytest.fixture
def keyed(loop_thread, serve_app, db_url, tmp_path):
    """(proxy, what the engine received): the mock engine behind a proxy with an upstream
    key of its own; the engine records each generation request's path, Authorization and
    body (a stream is continued as a completion of its tokens so far)."""
    received: list[tuple[str, str, bytes]] = []

    @web.middleware
    async def record(request, handler):
        if request.path in ("/v1/chat/completions", "/v1/completions"):
            received.append((request.path, request.headers.get("Authorization", ""),
                             await request.read()))
        return await handler(request)

    app = make_engine_app(EngineConfig(flavor="vllm"))
    app.middlewares.append(record)
    proxy = Proxy(loop_thread, Settings(
        upstream=serve_app(app) + "/v1", db=db_url, data_dir=str(tmp_path / "k"),
        port=free_port(), upstream_flavor="vllm", upstream_api_key="sk-engine-key")).start()
    yield proxy, received
    proxy.stop()


def test_a_continued_stream_and_a_resent_body_carry_the_proxys_key_and_the_same_body(keyed):
    """What the engine gets after a weight sync in abort mode: the continuation of a cut
    stream and the resend of a cut body are sent like the first attempt, with the proxy's
    upstream key (never the agent's) and, for the resend, the very body sent first."""
    proxy, received = keyed
    client = openai.OpenAI(base_url=proxy.episode_url("keyed"), api_key="agent-key",
                           max_retries=0)
    def weight_sync():
        assert proxy.admin("POST", "/tracetap/pause", {"mode": "abort", "timeout": 10})[0] == 200
        assert proxy.admin("POST", "/tracetap/resume", {})[0] == 200

    with client:
        assert _streamed(client, 12, weight_sync) == CONTENT
        streamed = len(received)
        assert streamed == 2  # the first attempt and its continuation

        answers = []

        def slow_call():
            answers.append(client.chat.completions.create(
                model="mock-model", messages=MESSAGES, max_tokens=200,
                extra_body={"mock_content": CONTENT, "mock_delay_s": 1.0}
            ).choices[0].message.content)

        worker = _abort_while_at_the_engine(proxy, slow_call)
        assert proxy.admin("POST", "/tracetap/resume", {})[0] == 200
        worker.join(30)
    assert answers == [CONTENT]
    assert [auth for _, auth, _ in received] == ["Bearer sk-engine-key"] * 4
    first, resent = received[streamed:]
    assert resent == first and json.loads(first[2])["messages"] == MESSAGES
