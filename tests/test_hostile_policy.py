"""One policy tries every shortcut on its own training signal, in one episode.

The agent is the policy under training: RL will learn whatever moves its reward. With
only its episode's base URL (which carries its key) and the real openai SDK, it tries
each lever the other test_hostile_* files test one by one: having its own text trained
(ids switched off, the prompt echoed, prompt logprobs), a judge model, an overlay of its
choosing, engine controls, failing on purpose (a bad body, a request the engine refuses,
a stream it closes early), reading its grade off the open metrics, and calling after its
finish. Then the episode is exported: every token at mask 1 is one the engine reported
as sampled for one of its calls, each exactly once, and the verdict is ``clean`` with the
agent's own causes recorded.
"""

from __future__ import annotations

import json

import msgspec
import openai
import pyarrow.parquet as pq
import pytest
from aiohttp import web
from helpers.hostile import MESSAGES
from helpers.http import finish, metrics_text, register
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.demo.engine import EngineConfig, make_engine_app
from tracetap.exporters import export
from tracetap.proxy.runtime.settings import Settings

CONTROLS = {"priority": -100, "request_id": "mine", "kv_transfer_params": {"x": 1},
            "vllm_xargs": {"a": 1}, "logits_processors": ["evil"]}


@pytest.fixture
def engine(serve_app) -> tuple[str, list, list]:
    """The mock vLLM engine: its /v1 URL, every model request body it received, and the
    completion ids of every whole reply it sent (what it sampled)."""
    received: list[dict] = []
    sampled: list[list[int]] = []

    @web.middleware
    async def record(request, handler):
        if request.method == "POST" and request.path.startswith("/v1/"):
            received.append(json.loads(await request.read()))
        response = await handler(request)
        body = getattr(response, "body", None)
        if request.path.startswith("/v1/") and response.status == 200 and body:
            for choice in msgspec.json.decode(bytes(body)).get("choices", ()):
                sampled.append(list(choice.get("token_ids") or ()))
        return response

    app = make_engine_app(EngineConfig(flavor="vllm"))
    app.middlewares.append(record)
    return serve_app(app) + "/v1", received, sampled


@pytest.fixture
def proxy(loop_thread, engine, tmp_path, migrated_sqlite):
    settings = Settings(upstream=engine[0], db=migrated_sqlite(tmp_path / "p.db"),
                        data_dir=str(tmp_path / "data"), port=free_port(),
                        upstream_flavor="vllm")
    proxy = Proxy(loop_thread, settings).start()
    yield proxy
    proxy.stop()


def _attacks(client: openai.OpenAI) -> None:
    """Every lever in turn; each that the proxy refuses is the client's 4xx."""
    refusals = [
        # its own prompt echoed back as if sampled, or its prompt's logprobs
        lambda: client.completions.create(model="mock-model", prompt="my own words " * 5,
                                          max_tokens=4, echo=True, logprobs=0),
        lambda: client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                               max_tokens=4,
                                               extra_body={"prompt_logprobs": 1}),
        # a judge or reward model the upstream also serves
        lambda: client.chat.completions.create(model="judge-model", messages=MESSAGES,
                                               max_tokens=4),
        # an overlay of its choosing
        lambda: client.chat.completions.create(
            model="mock-model", messages=MESSAGES, max_tokens=4,
            extra_headers={"X-Tracetap-Overlay": "anything"}),
        # a body that is not JSON, and one the engine refuses (its own 4xx)
        lambda: client.post("/chat/completions", cast_to=object, content=b"{not json",
                            options={"headers": {"Content-Type": "application/json"}}),
        lambda: client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                               max_tokens=2, extra_body={"mock_status": 400}),
    ]
    for attack in refusals:
        with pytest.raises(openai.APIStatusError) as refused:
            attack()
        assert 400 <= refused.value.status_code < 500, refused.value
    # the engine's id report and logprobs switched off, engine controls sent: served
    for extra in ({"return_token_ids": False, "logprobs": False}, CONTROLS):
        reply = client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                               max_tokens=6, extra_body=extra)
        assert reply.choices[0].message.content
    # a stream closed after its first chunk
    stream = client.chat.completions.create(
        model="mock-model", messages=MESSAGES, max_tokens=200, stream=True,
        extra_body={"mock_completion_tokens": 200, "mock_chunk_delay_s": 0.005})
    next(iter(stream))
    stream.close()


def test_a_policy_trying_every_shortcut_trains_only_what_the_engine_sampled(
        proxy, engine, tmp_path):
    _, received, sampled = engine
    created = register(proxy, "policy", policy_models=["mock-model"],
                       budget={"max_tokens": 100_000})
    with openai.OpenAI(base_url=created["base_url"], api_key="unused",
                       max_retries=0) as client:
        _attacks(client)
        # one honest turn, then the episode is finished with a reward by the environment
        client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=5)
        proxy.flush()
        finish(proxy, "policy", 0.0)
        with pytest.raises(openai.APIStatusError) as late:  # its key died with it
            client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                           max_tokens=5)
        assert late.value.status_code == 409
    assert not any(name in body for body in received for name in CONTROLS)
    assert not any(body.get("echo") or body.get("prompt_logprobs") for body in received)
    assert all(body.get("model") == "mock-model" for body in received)
    assert "tracetap_episode_reward" not in metrics_text(proxy.url)  # no grade on /metrics

    export(proxy.settings.db, tmp_path / "out")
    rows = [r for r in pq.read_table(tmp_path / "out" / "trajectories").to_pylist()
            if r["episode_id"] == "policy"]
    assert rows and {r["integrity"] for r in rows} == {"clean"}
    trained = [[t for t, m in zip(r["response_ids"], r["response_mask"]) if m]
               for r in rows]
    # Every sampled completion of a call the engine answered (200, whole reply) is
    # trained once, and nothing else is: three calls (ids off, controls, honest).
    engine_ids = sorted(ids for ids in sampled if ids)
    assert len(engine_ids) == 3
    assert sorted(t for row in trained for t in row) == sorted(
        t for ids in engine_ids for t in ids)
    for ids in engine_ids:  # each completion whole, in one row
        assert any(_contains(row, ids) for row in trained), ids
    # The agent's own failures are recorded as its own: 2 bodies refused by the proxy
    # (the engine's 4xx makes a third bad request), the stream it closed.
    causes = {c["cause"]: c["calls"] for c in rows[0]["integrity_causes"]}
    assert causes.get("agent_disconnect") == 1 and causes.get("agent_bad_request"), causes
    assert set(causes) <= {"agent_bad_request", "agent_disconnect"}, causes


def _contains(row: list[int], ids: list[int]) -> bool:
    n = len(ids)
    return any(row[i:i + n] == ids for i in range(len(row) - n + 1))
