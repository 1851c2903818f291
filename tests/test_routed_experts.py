"""Routed experts for MoE router replay: with --routed-experts the proxy asks
for each token's routing, keeps it from the agent, stores it and exports it aligned with
the tokens. Real openai SDK, proxy and mock engine (demo/experts.py routes by token id)."""

from __future__ import annotations

import json

import msgspec
import openai
import pyarrow.parquet as pq
import pytest

from tracetap.demo.experts import route
from tracetap.exporters import export
from tracetap.migrations import upgrade

MESSAGES = [{"role": "user", "content": "route me"}]


@pytest.fixture
def db_url(tmp_path):
    url = f"sqlite:///{tmp_path / 'tracetap.db'}"  # one database kind: the logic is the proxy's
    upgrade(url)
    return url


@pytest.fixture
def proxy_settings(proxy_settings):
    return msgspec.structs.replace(proxy_settings, routed_experts=True)


def _no_routing(value) -> None:
    text = json.dumps(value)
    assert "routed_experts" not in text  # neither a choice's nor the prompt's


def test_routing_is_stored_and_exported_aligned_and_never_reaches_the_agent(proxy, tmp_path):
    client = openai.OpenAI(base_url=proxy.episode_url("moe"), api_key="x", max_retries=0)
    with client:
        first = client.chat.completions.create(
            model="mock-model", messages=MESSAGES, max_tokens=64,
            extra_body={"mock_content": "Experts one."})
        _no_routing(first.model_dump())
        turn = [*MESSAGES, {"role": "assistant", "content": "Experts one."},
                {"role": "user", "content": "again"}]
        stream = client.chat.completions.create(
            model="mock-model", messages=turn, max_tokens=64, stream=True,
            extra_body={"mock_content": "Experts two, streamed."})
        text = ""
        for chunk in stream:
            _no_routing(chunk.model_dump())
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
    assert text == "Experts two, streamed."
    assert proxy.admin("POST", "/tracetap/episodes/moe/finish", {"reward": 1.0})[0] == 200
    proxy.flush()
    export(proxy.settings.db, tmp_path / "out")
    calls = pq.read_table(tmp_path / "out" / "calls").to_pylist()
    assert len(calls) == 2
    for call in calls:  # every completion token's routing, as the engine routed it
        assert call["routed_experts"] == route(call["completion_ids"])
    [row] = pq.read_table(tmp_path / "out" / "trajectories").to_pylist()
    assert row["num_turns"] == 2  # the turns merged: alignment is across turns
    routing, ids, mask = row["response_routed_experts"], row["response_ids"], row["response_mask"]
    assert len(routing) == len(ids)
    for token, routed, trained in zip(ids, routing, mask, strict=True):
        # Completion tokens carry their routing; the observation between turns has none.
        assert routed == (route([token])[0] if trained else None)
    assert None in routing and any(r is not None for r in routing)
