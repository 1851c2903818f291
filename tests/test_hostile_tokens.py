"""The agent cannot have its own text trained as sampled output.

A policy under training sends its requests through the proxy; whatever it can change
about its own training data, RL will learn to change. Here it tries to switch off the
engine's id report (``return_token_ids: false``, ``logprobs: false``) and to have its
prompt sent back (completions ``echo``, vLLM's ``prompt_logprobs``): the exported rows
must hold, at mask 1, only the tokens the engine reported as sampled for that call.
Every request runs against a logging upstream that records the bodies it received.
"""

from __future__ import annotations

import json

import openai
import pyarrow.parquet as pq
import pytest
from aiohttp import web
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.demo import tokenizer as tok
from tracetap.demo.engine import EngineConfig, make_engine_app
from tracetap.exporters import export
from tracetap.proxy.runtime.settings import Settings

# 60 bytes of the agent's own text: the mock engine's tokens are one byte each.
PROMPT = "I am the policy and these sixty bytes are my very own words!"
SAMPLED = 8


@pytest.fixture
def hostile(loop_thread, recording_engine, tmp_path, migrated_sqlite):
    settings = Settings(upstream=recording_engine,
                        db=migrated_sqlite(tmp_path / "t.db"),
                        data_dir=str(tmp_path / "data"), port=free_port(),
                        upstream_flavor="vllm")
    proxy = Proxy(loop_thread, settings).start()
    yield proxy
    proxy.stop()


def _client(proxy, episode: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.episode_url(episode), api_key="sk-agent",
                         max_retries=0)


def _trained(proxy, tmp_path, episode: str) -> list[dict]:
    """The episode's exported rows, after it is finished (with any reward)."""
    proxy.admin("POST", f"/tracetap/episodes/{episode}/finish", {"reward": 1.0})
    export(proxy.settings.db, tmp_path / "out")
    return [r for r in pq.read_table(tmp_path / "out" / "trajectories").to_pylist()
            if r["episode_id"] == episode]


def test_ids_switched_off_and_the_prompt_echoed_are_refused(hostile, bodies, tmp_path):
    with _client(hostile, "e1") as client:
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(
                model="mock-model", prompt=PROMPT, max_tokens=SAMPLED, echo=True,
                logprobs=0, extra_body={"return_token_ids": False})
        # The same attack minus the echo: a plain call, whose ids the proxy still asks.
        reply = client.completions.create(
            model="mock-model", prompt=PROMPT, max_tokens=SAMPLED,
            extra_body={"return_token_ids": False})
    assert refused.value.body["code"] == "unsupported_parameter"
    assert refused.value.body["param"] == "echo"
    # Nothing of the refused request reached the engine; the other asked for the ids.
    assert [p for p, _ in bodies] == ["/v1/completions"]
    assert bodies[0][1]["return_token_ids"] is True
    # The client asked for no ids: it gets none (nor the logprobs it did not ask for).
    assert reply.choices[0].logprobs is None
    assert getattr(reply.choices[0], "token_ids", None) is None
    refused_call, call = hostile.calls("e1")
    assert (refused_call["status"], call["status"]) == ("bad_request", "ok")
    [choice] = call["choices"]
    assert choice["token_source"] == "engine"
    rows = _trained(hostile, tmp_path, "e1")
    assert [sum(r["response_mask"]) for r in rows] == [SAMPLED]
    assert rows[0]["prompt_ids"] == tok.encode(PROMPT)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_with_ids_and_logprobs_switched_off_trains_only_sampled_tokens(
        hostile, bodies, tmp_path, stream):
    with _client(hostile, "e2") as client:
        out = client.chat.completions.create(
            model="mock-model", messages=[{"role": "user", "content": PROMPT}],
            max_tokens=SAMPLED, logprobs=False, stream=stream,
            **({"stream_options": {"include_usage": False}} if stream else {}),
            extra_body={"return_token_ids": False, "mock_content": "abcdefgh" * 3})
        if stream:
            chunks = list(out)
            assert all(c.choices[0].logprobs is None for c in chunks if c.choices)
            assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks)
            assert all(getattr(c.choices[0], "token_ids", None) is None
                       for c in chunks if c.choices)
            assert all(c.usage is None for c in chunks)
        else:
            assert out.choices[0].logprobs is None
            assert getattr(out, "prompt_token_ids", None) is None
    [(_, sent)] = bodies
    assert sent["return_token_ids"] is True and sent["logprobs"] is True
    if stream:  # the usage the budget settles on, asked for over the client's false
        assert sent["stream_options"] == {"include_usage": True}
        assert hostile.calls("e2")[0]["completion_tokens"] == SAMPLED
    rows = _trained(hostile, tmp_path, "e2")
    assert [sum(r["response_mask"]) for r in rows] == [SAMPLED]
    assert bytes(rows[0]["response_ids"][-SAMPLED:]) == b"abcdefgh"


@pytest.mark.parametrize("api,extra", [
    ("completions", {"prompt_logprobs": 5}),
    ("completions", {"echo": 1}),
    ("chat", {"prompt_logprobs": 0}),
    ("chat", {"echo": True}),
])
def test_prompt_logprobs_and_echo_are_refused_in_the_clients_shape(hostile, bodies, api, extra):
    with _client(hostile, "e3") as client, pytest.raises(openai.BadRequestError) as refused:
        if api == "chat":
            client.chat.completions.create(model="mock-model", messages=[
                {"role": "user", "content": PROMPT}], max_tokens=4, extra_body=extra)
        else:
            client.completions.create(model="mock-model", prompt=PROMPT, max_tokens=4,
                                      extra_body=extra)
    assert refused.value.status_code == 400
    assert refused.value.body["param"] == next(iter(extra))
    assert bodies == []


def test_echo_false_and_null_prompt_logprobs_are_plain_calls(hostile, bodies):
    with _client(hostile, "e4") as client:
        reply = client.completions.create(model="mock-model", prompt=PROMPT, max_tokens=4,
                                          echo=False, extra_body={"prompt_logprobs": None})
    assert not reply.choices[0].text.startswith(PROMPT)
    assert len(bodies) == 1


@pytest.fixture
def echoing(loop_thread, serve_app, tmp_path, migrated_sqlite):
    """A proxy in front of an engine that echoes the prompt whatever it is asked (a
    server-side default the proxy cannot see), reporting no ids: what comes back has more
    token strings than the engine's usage says it sampled."""

    @web.middleware
    async def echo(request, handler):
        if request.path == "/v1/completions":
            body = json.loads(await request.read())
            body.pop("return_token_ids", None)
            request._read_bytes = json.dumps({**body, "echo": True}).encode()
        return await handler(request)

    app = make_engine_app(EngineConfig(flavor="vllm"))
    app.middlewares.append(echo)
    settings = Settings(upstream=serve_app(app) + "/v1", db=migrated_sqlite(tmp_path / "e.db"),
                        data_dir=str(tmp_path / "echo"), port=free_port(),
                        upstream_flavor="vllm")
    proxy = Proxy(loop_thread, settings).start()
    yield proxy
    proxy.stop()


def test_token_strings_beyond_what_the_engine_sampled_are_never_trained(echoing, tmp_path):
    with _client(echoing, "e5") as client:
        reply = client.completions.create(model="mock-model", prompt=PROMPT,
                                          max_tokens=SAMPLED)
    assert reply.usage.completion_tokens == SAMPLED
    assert reply.choices[0].text.startswith(PROMPT)  # the engine did echo
    [call] = echoing.calls("e5")
    [choice] = call["choices"]
    assert choice["completion_ids"] is None and call["ids_missing"] == "unverified"
    # Left out of training rather than trained as 68 sampled tokens.
    assert _trained(echoing, tmp_path, "e5") == []
