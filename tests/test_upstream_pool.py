"""Several upstreams behind one proxy, and pausing for a weight update."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
from helpers.http import get
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.demo.engine import EngineConfig, EngineServer
from tracetap.proxy.runtime.settings import Settings
from tracetap.proxy.upstream.pool import Pool
from tracetap.proxy.upstream.specs import UpstreamSpec, parse_upstreams

MESSAGES = [{"role": "user", "content": "hi"}]


def _admin_post(proxy, path: str, body: dict) -> dict:
    status, reply = proxy.admin("POST", path, body)
    assert status == 200, reply
    return reply


def test_rendezvous_affinity_is_stable_and_moves_only_a_dead_targets_episodes():
    pool = Pool([UpstreamSpec(f"http://u{i}:8000/v1") for i in range(3)], client=None)
    episodes = [f"ep-{i}" for i in range(300)]
    before = {e: pool.candidates(e, None)[0] for e in episodes}
    assert len({t.base_url for t in before.values()}) == 3
    dead = pool.targets[1]
    pool.mark_down(dead)
    after = {e: pool.candidates(e, None)[0] for e in episodes}
    for e in episodes:
        if before[e] is dead:
            assert after[e] is not dead
        else:
            assert after[e] is before[e]


def test_model_routing_and_parsing():
    specs = parse_upstreams(["http://a/v1,http://b/v1", "model=big,url=http://c/v1"])
    assert specs == [UpstreamSpec("http://a/v1"), UpstreamSpec("http://b/v1"),
                     UpstreamSpec("http://c/v1", "big")]
    pool = Pool(specs, client=None)
    assert pool.candidates("e", "big")[0].base_url == "http://c/v1"
    assert {t.base_url for t in pool.candidates("e", "small")} == {"http://a/v1", "http://b/v1"}


def test_a_call_goes_to_the_upstream_of_its_model(loop_thread, db_url, tmp_path):
    """``model=NAME,url=URL``: a call for that model is sent there, others to the rest."""
    engines = [EngineServer(EngineConfig()) for _ in range(2)]
    for e in engines:
        loop_thread.run(e.start())
    settings = Settings(upstream=[engines[0].url, f"model=big,url={engines[1].url}"],
                        db=db_url, port=free_port(), data_dir=str(tmp_path / "d"))
    proxy = Proxy(loop_thread, settings).start()
    try:
        client = openai.OpenAI(base_url=proxy.episode_url("models"), api_key="x",
                               max_retries=0)
        with client:
            for model in ("big", "small"):
                client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
        assert [c["upstream"] for c in proxy.calls("models")] == [e.url for e in engines[::-1]]
    finally:
        proxy.stop()
        for e in engines:
            loop_thread.run(e.close())


def test_three_upstreams_affinity_failover_and_return(loop_thread, db_url, tmp_path):
    engines = [EngineServer(EngineConfig()) for _ in range(3)]
    for e in engines:
        loop_thread.run(e.start())
    settings = Settings(upstream=[e.url for e in engines], db=db_url, port=free_port(),
                        data_dir=str(tmp_path / "d"))
    proxy = Proxy(loop_thread, settings).start()
    try:
        def turn(episode: str) -> None:
            client = openai.OpenAI(base_url=proxy.episode_url(episode), api_key="x",
                                   max_retries=0)
            with client:
                client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                               max_tokens=4)

        episodes = [f"aff-{i}" for i in range(9)]
        for _ in range(2):
            for episode in episodes:
                turn(episode)
        home = {}
        for episode in episodes:
            served = {c["upstream"] for c in proxy.calls(episode)}
            assert len(served) == 1, "an episode's calls must stick to one upstream"
            home[episode] = served.pop()
        assert len(set(home.values())) >= 2

        victim = engines[0]
        port = victim.port
        loop_thread.run(victim.close())
        for episode in episodes:  # no error for calls that were not in flight on it
            turn(episode)
        for episode in episodes:
            last = proxy.calls(episode)[-1]["upstream"]
            assert last != victim.url
            if home[episode] != victim.url:
                assert last == home[episode]  # only the dead upstream's episodes moved

        revived = EngineServer(EngineConfig(), port=port)
        loop_thread.run(revived.start())
        engines[0] = revived
        ready = get(proxy.url + "/readyz")[1]  # runs a health check
        assert all(u["healthy"] for u in ready["upstreams"])
        for episode in episodes:
            turn(episode)
            assert proxy.calls(episode)[-1]["upstream"] == home[episode]
    finally:
        proxy.stop()
        for e in engines:
            loop_thread.run(e.close())


def test_pause_holds_new_calls_and_resume_stamps_the_new_policy(proxy):
    _admin_post(proxy, "/tracetap/resume", {"policy_version": "v1"})

    def stream(tag: str, first: threading.Event | None = None) -> str:
        client = openai.OpenAI(base_url=proxy.episode_url("pause"), api_key="x", max_retries=0)
        with client:
            chunks = client.chat.completions.create(
                model="mock-model", stream=True, messages=[{"role": "user", "content": tag}],
                extra_body={"mock_completion_tokens": 20, "mock_chunk_delay_s": 0.02})
            finish = None
            for chunk in chunks:
                if first is not None:
                    first.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            return finish

    with ThreadPoolExecutor(10) as pool:
        firsts = [threading.Event() for _ in range(4)]
        before = [pool.submit(stream, f"before-{i}", firsts[i]) for i in range(4)]
        for event in firsts:
            assert event.wait(10)
        paused = pool.submit(_admin_post, proxy, "/tracetap/pause", {"timeout": 30})
        deadline = time.monotonic() + 10
        while not get(proxy.url + "/readyz")[1]["paused"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)  # polling until the pause is in effect
        during = [pool.submit(stream, f"during-{i}") for i in range(4)]
        result = paused.result(30)
        assert result["drained"] and result["inflight"] == 0
        assert [f.result(10) for f in before] == ["stop"] * 4  # finished while paused
        assert not any(f.done() for f in during)  # held until the resume
        _admin_post(proxy, "/tracetap/resume", {"policy_version": "v2"})
        assert [f.result(30) for f in before + during] == ["stop"] * 8
    calls = proxy.calls("pause")
    versions = {json.loads(c["request"])["messages"][0]["content"]: c["policy_version"]
                for c in calls}
    assert len(calls) == 8
    assert versions == {**{f"before-{i}": "v1" for i in range(4)},
                        **{f"during-{i}": "v2" for i in range(4)}}


def test_a_call_held_too_long_gets_a_503_with_retry_after(loop_thread, engine, db_url,
                                                          tmp_path):
    settings = Settings(upstream=engine.url, db=db_url, port=free_port(),
                        data_dir=str(tmp_path / "d"), pause_timeout=0.2)
    proxy = Proxy(loop_thread, settings).start()
    try:
        _admin_post(proxy, "/tracetap/pause", {})
        client = openai.OpenAI(base_url=proxy.episode_url("held"), api_key="x", max_retries=0)
        with client:
            try:
                client.chat.completions.create(model="mock-model", messages=MESSAGES)
                raise AssertionError("expected a 503")
            except openai.APIStatusError as err:
                assert err.status_code == 503 and err.response.headers["Retry-After"]
        [call] = proxy.calls("held")
        assert call["http_status"] == 503 and call["status"] == "paused"
    finally:
        proxy.stop()
