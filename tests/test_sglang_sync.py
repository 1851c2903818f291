"""SGLang's weight-sync abort when it goes wrong, and SGLang's routed experts: the mock
engine's ``sglang`` flavor (demo/sglang.py) through the proxy, with the real openai SDK.

- ``/abort_request`` answers non-200: nothing was aborted, so the stream finishes on the
  old weights as in a drain (the sync waits for it), whole, with no token stamped with
  the new version; counted as ``abort_refused``.
- The abort ends the stream without its ids (SGLang leaves them out after an error
  abort): nothing can be continued, so the call is cut as an upstream failure, stored
  with what it had, counted as ``ended_without_ids``.
"""

from __future__ import annotations

import json
import threading
import time

import openai
import pyarrow.parquet as pq
import pytest
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.demo import tokenizer as tok
from tracetap.demo.engine import EngineConfig
from tracetap.demo.engine_common import ABORTS
from tracetap.demo.experts import route
from tracetap.demo.sglang import ABORTED
from tracetap.exporters import export
from tracetap.proxy.runtime.settings import Settings
from tracetap.storage import policy_spans

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."}]
CONTENT = "The quick brown fox jumps over the lazy dog, then rests by the river bank."


@pytest.fixture
def engine_config() -> EngineConfig:
    return EngineConfig(flavor="sglang")


@pytest.fixture
def db_url(tmp_path, migrated_sqlite):
    return migrated_sqlite(tmp_path / "tracetap.db")  # the logic is the proxy's


def _metric(proxy, outcome: str) -> float:
    text = proxy.state.metrics.render().decode()
    line = f'tracetap_weight_sync_cuts_total{{outcome="{outcome}"}} '
    found = [float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)]
    return found[0] if found else 0.0


def _spans(proxy, call: dict) -> list:
    async def read():
        async with proxy.state.engine.connect() as conn:
            rows = await conn.exec_driver_sql(
                "SELECT policy_spans FROM choices WHERE call_id = ?", (call["call_id"],))
            return [r[0] for r in rows]
    [raw] = proxy.loop.run(read())
    return policy_spans.spans_of(raw, call["policy_version"],
                                 len(call["choices"][0]["completion_ids"]))


def _stream_with_sync(proxy, episode: str, sync) -> tuple[str, list, threading.Thread]:
    """A chat stream of CONTENT; ``sync`` runs in a thread once its 12th chunk is in."""
    client = openai.OpenAI(base_url=proxy.episode_url(episode), api_key="x", max_retries=0)
    text, reasons = [], []
    worker = threading.Thread(target=sync)
    with client, client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=200, stream=True,
            extra_body={"mock_content": CONTENT, "mock_chunk_delay_s": 0.03}) as chunks:
        for i, chunk in enumerate(chunks):
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                reasons.append(choice.finish_reason)
            if i == 12:
                worker.start()
    return "".join(text), reasons, worker


def test_an_abort_sglang_refuses_finishes_the_stream_on_the_old_weights(proxy, engine):
    assert proxy.admin("PUT", "/tracetap/policy", {"version": "v1"})[0] == 200
    app = engine._runner.app
    app[ABORTED].answer = 503
    synced: list[float] = []

    def weight_sync():
        status, answer = proxy.admin("POST", "/tracetap/pause", {"mode": "abort", "timeout": 10})
        assert status == 200 and answer["drained"] is True
        synced.append(time.time())  # the weights would change now
        assert proxy.admin("POST", "/tracetap/resume", {"policy_version": "v2"})[0] == 200

    text, reasons, worker = _stream_with_sync(proxy, "sg-refused", weight_sync)
    worker.join(15)
    assert synced and text == CONTENT and reasons[-1] == "stop"  # whole, one answer
    assert app[ABORTED].count == 1 and app[ABORTS].count == 0  # asked once, never cut
    [call] = proxy.calls("sg-refused")
    [choice] = call["choices"]
    assert call["status"] == "ok" and call["policy_version"] == "v1"
    assert choice["completion_ids"] == [*CONTENT.encode(), tok.EOS]  # nothing lost
    assert len(choice["completion_logprobs"]) == len(choice["completion_ids"])
    assert call["t_end"] <= synced[0]  # the sync waited for it, as in a drain
    # No token is stamped with the new weights: v1 before the pause, unknown during it.
    assert all(version in ("v1", None) for _, version in _spans(proxy, call))
    assert _metric(proxy, "abort_refused") == 1
    assert _metric(proxy, "continued") == 0


def test_an_abort_ending_without_ids_is_cut_as_an_upstream_failure(proxy, engine):
    assert proxy.admin("PUT", "/tracetap/policy", {"version": "v1"})[0] == 200
    app = engine._runner.app
    app[ABORTED].drop_ids = True
    done: list[bool] = []

    def weight_sync():
        status, answer = proxy.admin("POST", "/tracetap/pause", {"mode": "abort", "timeout": 10})
        assert status == 200 and answer["drained"] is True
        assert proxy.admin("POST", "/tracetap/resume", {"policy_version": "v2"})[0] == 200
        done.append(True)

    with pytest.raises(openai.APIError):  # the client's stream ends abruptly, as ours did
        _stream_with_sync(proxy, "sg-noids", weight_sync)
    for _ in range(200):
        if done:
            break
        time.sleep(0.05)
    assert done and app[ABORTED].count == 1
    [call] = proxy.calls("sg-noids")
    assert call["status"] == "upstream_error"
    assert "without its token ids" in call["error"]
    [choice] = call["choices"]
    assert choice["finish_reason"] is None  # cut: the engine's abort ending is not an answer
    assert 0 < len(choice["text"]) < len(CONTENT)  # what it had, recorded
    assert CONTENT.startswith(choice["text"])
    assert _metric(proxy, "ended_without_ids") == 1
    assert _metric(proxy, "continued") == 0


def test_the_clients_own_usage_chunk_survives_the_ids_the_proxy_strips(proxy):
    """The usage chunk the client asked for has ``choices: []`` like SGLang's ids chunk
    the proxy drops: it is kept."""
    client = openai.OpenAI(base_url=proxy.episode_url("sg-usage"), api_key="x", max_retries=0)
    with client, client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=16, stream=True,
            stream_options={"include_usage": True}) as chunks:
        got = [c.model_dump() for c in chunks]
    assert got[-1]["choices"] == [] and got[-1]["usage"]["completion_tokens"] > 0
    assert all(c["choices"] for c in got[:-1])
    assert "sglext" not in json.dumps(got)


# ---- routed experts: SGLang's sglext.routed_experts ------------------------------------------

def _flat(token: int) -> list[list[int]]:
    """One position's routing as stored from SGLang: one row of layers * top_k ids."""
    return [[e for layer in route([token])[0] for e in layer]]


def test_sglang_routed_experts_are_stored_and_exported_and_never_reach_the_agent(
        loop_thread, engine, db_url, tmp_path):
    settings = Settings(upstream=engine.url, db=db_url, data_dir=str(tmp_path / "d"),
                        port=free_port(), upstream_flavor="sglang", routed_experts=True)
    proxy = Proxy(loop_thread, settings).start()
    try:
        client = openai.OpenAI(base_url=proxy.episode_url("sg-moe"), api_key="x",
                               max_retries=0)
        with client:
            whole = client.chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=64,
                extra_body={"mock_content": "Experts one."})
            seen = [whole.model_dump()]
            with client.chat.completions.create(
                    model="m", messages=MESSAGES, max_tokens=64, stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"mock_content": "Experts two."}) as chunks:
                streamed = [c.model_dump() for c in chunks]
            seen += streamed
            assert streamed[-1]["usage"]["completion_tokens"] > 0  # the client's, kept
            done = client.completions.create(model="m", prompt="Once upon", max_tokens=16,
                                             extra_body={"mock_content": "a time"})
            seen.append(done.model_dump())
            with client.completions.create(model="m", prompt="Once upon", max_tokens=16,
                                           stream=True,
                                           extra_body={"mock_content": "a time"}) as chunks:
                seen += [c.model_dump() for c in chunks]
        text = json.dumps(seen)
        assert "routed_experts" not in text and "sglext" not in text  # none reach the agent
        assert all(c["choices"] or c["usage"] for c in seen if "choices" in c)  # none empty
        assert proxy.admin("POST", "/tracetap/episodes/sg-moe/finish", {"reward": 1.0})[0] == 200
        proxy.flush()
        export(settings.db, tmp_path / "out")
    finally:
        proxy.stop()
    calls = pq.read_table(tmp_path / "out" / "calls").to_pylist()
    assert len(calls) == 4
    for call in calls:  # every completion token but the last (never fed back) is routed
        ids = call["completion_ids"]
        assert len(ids) > 2
        assert call["routed_experts"] == [_flat(t) for t in ids[:-1]], call["endpoint"]


def test_sglang_routing_of_a_stream_continued_after_a_weight_sync_is_whole(
        loop_thread, engine, db_url, tmp_path):
    """Cut by SGLang's abort and continued on ``/v1/completions``: the continuation's
    ``sglext.routed_experts`` covers the whole sequence, and is what is stored."""
    settings = Settings(upstream=engine.url, db=db_url, data_dir=str(tmp_path / "d"),
                        port=free_port(), upstream_flavor="sglang", routed_experts=True)
    proxy = Proxy(loop_thread, settings).start()
    try:
        def weight_sync():
            pause = {"mode": "abort", "timeout": 10}
            assert proxy.admin("POST", "/tracetap/pause", pause)[0] == 200
            assert proxy.admin("POST", "/tracetap/resume", {"policy_version": "v2"})[0] == 200

        text, reasons, worker = _stream_with_sync(proxy, "sg-moe-sync", weight_sync)
        worker.join(15)
        assert text == CONTENT and "abort" not in reasons
        assert _metric(proxy, "continued") == 1
        assert proxy.admin("POST", "/tracetap/episodes/sg-moe-sync/finish", {})[0] == 200
        proxy.flush()
        export(settings.db, tmp_path / "out")
    finally:
        proxy.stop()
    [call] = pq.read_table(tmp_path / "out" / "calls").to_pylist()
    ids = call["completion_ids"]
    assert ids == [*CONTENT.encode(), tok.EOS]
    assert call["routed_experts"] == [_flat(t) for t in ids[:-1]]
