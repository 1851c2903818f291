"""/metrics after known traffic: exact counts, histograms that moved, bounded labels.

Traffic goes through the real ``openai`` SDK; the exposition is read back with
prometheus-client's own parser, so the test checks what Prometheus would scrape.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections import Counter as Tally
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web
from helpers.http import admin_metrics_text, post
from helpers.loop import LoopThread, free_port
from helpers.servers import Proxy
from prometheus_client.parser import text_string_to_metric_families

from tracetap.demo.engine import EngineServer
from tracetap.migrations import upgrade
from tracetap.proxy.runtime.metrics import OTHER, Metrics
from tracetap.proxy.runtime.settings import Settings

MESSAGES = [{"role": "user", "content": "Name three rivers."}]
Samples = dict[tuple[str, frozenset], float]


def _parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(proxy: Proxy) -> Samples:
    with urllib.request.urlopen(proxy.url + "/metrics") as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        return _parse(resp.read().decode())


def admin_scrape(proxy: Proxy) -> Samples:
    """The admin's page: /metrics and the episode outcome families."""
    return _parse(admin_metrics_text(proxy.url, proxy.admin_token))


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 for a labelled series that was never touched."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def settled(proxy: Proxy, timeout: float = 30.0) -> Samples:
    """Scrape once every handler has left (a stream's bookkeeping ends after its last byte)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(proxy)
        if value(samples, "tracetap_inflight_requests") == 0 or time.monotonic() > deadline:
            return samples
        time.sleep(0.01)


def _known_traffic(client: openai.OpenAI) -> tuple[int, int]:
    """Three chat calls (one streamed), two completions (one streamed), one upstream 400,
    one passthrough. Returns the (prompt, completion) token sums the client was told."""
    usages = [
        client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                       max_tokens=8).usage,
        client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                       max_tokens=5).usage,
        client.completions.create(model="mock-model", prompt="Once upon a time",
                                  max_tokens=7).usage,
    ]
    # Asking for the usage chunk ourselves, so the client sees what the stream cost.
    for stream in (
        client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=6,
                                       stream=True, stream_options={"include_usage": True}),
        client.completions.create(model="mock-model", prompt="In a hole", max_tokens=4,
                                  stream=True, stream_options={"include_usage": True}),
    ):
        chunks = list(stream)
        assert chunks[-1].usage is not None
        usages.append(chunks[-1].usage)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                       extra_body={"mock_status": 400})
    assert [m.id for m in client.models.list()] == ["mock-model"]
    return sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages)


def test_scrape_after_known_traffic(proxy):
    episode = "metrics-traffic"
    before = scrape(proxy)
    client = openai.OpenAI(base_url=proxy.episode_url(episode), api_key="x", max_retries=0)
    with client:
        prompt_tokens, completion_tokens = _known_traffic(client)
    calls = proxy.calls(episode)  # flushes the writer first
    after = settled(proxy)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # Requests by route and status code, exactly.
    assert delta("tracetap_requests_total", route="chat_completions", code="200") == 3
    assert delta("tracetap_requests_total", route="chat_completions", code="400") == 1
    assert delta("tracetap_requests_total", route="completions", code="200") == 2
    assert delta("tracetap_requests_total", route="passthrough", code="200") == 1

    # Every captured request moved its histograms; streams also moved time to first token.
    chat, comp = {"route": "chat_completions"}, {"route": "completions"}
    for name in ("tracetap_request_duration_seconds_count", "tracetap_overhead_seconds_count"):
        assert delta(name, **chat, stream="false") == 3
        assert delta(name, **chat, stream="true") == 1
        assert delta(name, **comp, stream="false") == 1
        assert delta(name, **comp, stream="true") == 1
    assert delta("tracetap_upstream_duration_seconds_count", **chat) == 4
    assert delta("tracetap_upstream_duration_seconds_count", **comp) == 2
    assert delta("tracetap_time_to_first_token_seconds_count", **chat) == 1
    assert delta("tracetap_time_to_first_token_seconds_count", **comp) == 1
    for route in ("chat_completions", "completions"):
        total = sum(delta("tracetap_request_duration_seconds_sum", route=route, stream=s)
                    for s in ("true", "false"))
        overhead = sum(delta("tracetap_overhead_seconds_sum", route=route, stream=s)
                       for s in ("true", "false"))
        upstream = delta("tracetap_upstream_duration_seconds_sum", route=route)
        assert total > 0 and upstream > 0 and overhead >= 0
        assert overhead <= total and upstream <= total
        ttft = delta("tracetap_time_to_first_token_seconds_sum", route=route)
        assert 0 < ttft <= delta("tracetap_request_duration_seconds_sum", route=route,
                                 stream="true")

    # Tokens by type equal what the upstream reported, all under the one known model.
    assert delta("tracetap_tokens_total", type="prompt", model="mock-model") == prompt_tokens
    assert delta("tracetap_tokens_total", type="completion",
                 model="mock-model") == completion_tokens
    assert prompt_tokens == sum(c["prompt_tokens"] or 0 for c in calls)
    assert completion_tokens == sum(c["completion_tokens"] or 0 for c in calls)

    # Storage: every call (the upstream 400 included) written, none dropped, queue empty.
    assert len(calls) == 6
    assert delta("tracetap_records_total", outcome="written") == len(calls)
    for outcome in ("dropped", "spilled", "replayed"):
        assert value(after, "tracetap_records_total", outcome=outcome) == 0
    assert delta("tracetap_db_batch_size_sum") == len(calls)
    assert delta("tracetap_db_write_duration_seconds_count") >= 1
    assert value(after, "tracetap_capture_queue_depth") == 0
    assert value(after, "tracetap_inflight_requests") == 0
    assert ("tracetap_journal_bytes", frozenset()) in after
    assert value(after, "tracetap_logprobs_missing_total") == 0
    # One choice per captured answer (the upstream 400 has none), each with its token ids.
    assert delta("tracetap_choices_total") == 5
    assert not [key for key in after if key[0] == "tracetap_token_ids_missing_total"]

    # Labels never carry the episode id.
    assert not any(episode in v for _, labels in after for _, v in labels)


def test_buckets_fit_the_quantity(proxy):
    openai_client = openai.OpenAI(base_url=proxy.episode_url("buckets"), api_key="x")
    with openai_client:
        openai_client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                              max_tokens=2)
    samples = settled(proxy)

    def bounds(name: str) -> list[float]:
        return sorted({float(dict(labels)["le"]) for n, labels in samples
                       if n == name + "_bucket"} - {float("inf")})

    overhead = bounds("tracetap_overhead_seconds")
    assert overhead[0] < 0.001 and overhead[-1] == pytest.approx(0.1)
    for name in ("tracetap_request_duration_seconds", "tracetap_upstream_duration_seconds"):
        assert bounds(name)[-1] == 300
    # time to first token has no observation yet: no series, but its family is declared.
    assert "tracetap_time_to_first_token_seconds" in proxy.state.metrics.render().decode()


def _model_labels(samples: Samples) -> set[str]:
    return {dict(labels)["model"] for name, labels in samples if name == "tracetap_tokens_total"}


def test_a_thousand_model_names_collapse_to_other():
    metrics = Metrics()
    names = [f"model-{i}" for i in range(1000)]
    for name in names:
        metrics.tokens.labels("prompt", metrics.model(name)).inc(3)
    samples = _parse(metrics.render().decode())
    models = _model_labels(samples)
    assert models == {*names[: metrics.max_models], OTHER}
    # A name seen before the cap keeps its own series; nothing was lost in collapsing.
    assert metrics.model(names[0]) == names[0]
    assert metrics.model(names[500]) == OTHER
    assert metrics.model(None) == OTHER and metrics.model("") == OTHER
    total = sum(v for (n, _), v in samples.items() if n == "tracetap_tokens_total")
    assert total == 3 * len(names)
    # The whole exposition stays small: the thousand names add one series per kept name
    # and one for "other" (each with its `_created` sample), whatever else is exported.
    added = len(samples) - len(_parse(Metrics().render().decode()))
    assert added <= 2 * (metrics.max_models + 1)


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'tracetap.db'}"
    upgrade(url)
    return url


@pytest.fixture
def own_proxy(loop_thread, engine, sqlite_url, tmp_path, request):
    """A proxy on SQLite with per-test settings overrides (``indirect`` parametrize)."""
    overrides = getattr(request, "param", {})
    settings = Settings(upstream=engine.url, db=sqlite_url, data_dir=str(tmp_path / "data"),
                        port=free_port(), **overrides)
    proxy = Proxy(loop_thread, settings).start()
    yield proxy
    proxy.stop()


def test_a_thousand_models_through_requests_stay_bounded(own_proxy, loop_thread):
    names = [f"tuned-{i}" for i in range(1000)]
    url = own_proxy.episode_url("many-models") + "/completions"

    async def send_all() -> int:
        gate = asyncio.Semaphore(16)
        async with aiohttp.ClientSession() as session:
            async def one(name: str) -> int:
                body = {"model": name, "prompt": "hi", "max_tokens": 1}
                async with gate, session.post(url, json=body) as resp:
                    assert resp.status == 200
                    return (await resp.json())["usage"]["prompt_tokens"]
            return sum(await asyncio.gather(*(one(n) for n in names)))

    prompt_tokens = loop_thread.run(send_all(), timeout=120)
    own_proxy.flush()
    samples = settled(own_proxy)
    models = _model_labels(samples)
    assert OTHER in models and len(models) == own_proxy.state.metrics.max_models + 1
    per_type = Tally()
    for (name, labels), v in samples.items():
        if name == "tracetap_tokens_total":
            per_type[dict(labels)["type"]] += v
    assert per_type["prompt"] == prompt_tokens
    assert per_type["completion"] == len(names)
    assert value(samples, "tracetap_records_total", outcome="written") == len(names)
    token_series = sum(1 for name, _ in samples if name == "tracetap_tokens_total")
    assert token_series == 2 * len(models)  # prompt and completion per kept name
    # 1,000 models did not become thousands of series (buckets included).
    assert sum(1 for name, _ in samples if name.startswith("tracetap_")) < 250


def _chat_headers(proxy: Proxy, stream: bool):
    client = openai.OpenAI(base_url=proxy.episode_url("header"), api_key="x")
    with client:
        raw = client.chat.completions.with_raw_response.create(
            model="mock-model", messages=MESSAGES, max_tokens=3, stream=stream)
        parsed = raw.parse()
        if stream:
            list(parsed)  # drain, so the handler finishes
        return raw.headers


def test_overhead_header_on_non_streaming_responses(own_proxy):
    headers = _chat_headers(own_proxy, stream=False)
    overhead_ms = float(headers["x-tracetap-overhead-ms"])
    assert 0 <= overhead_ms < 1000
    # A stream's headers leave before its overhead is known.
    assert "x-tracetap-overhead-ms" not in _chat_headers(own_proxy, stream=True)


@pytest.mark.parametrize("own_proxy", [{"overhead_header": False}], indirect=True)
def test_no_overhead_header_when_turned_off(own_proxy):
    assert "x-tracetap-overhead-ms" not in _chat_headers(own_proxy, stream=False)
    assert "x-tracetap-overhead-ms" not in _chat_headers(own_proxy, stream=True)
    # The metric still moves: only the header is off.
    samples = settled(own_proxy)
    assert value(samples, "tracetap_overhead_seconds_count", route="chat_completions",
                 stream="false") == 1


def test_pause_and_finished_episodes(own_proxy):
    samples = scrape(own_proxy)
    assert value(samples, "tracetap_pause_timeout_seconds") == own_proxy.settings.pause_timeout
    assert value(samples, "tracetap_paused") == 0
    assert value(samples, "tracetap_pause_start_time_seconds") == 0

    before = time.time()
    assert own_proxy.admin("POST", "/tracetap/pause", {"wait": False})[0] == 200
    after = time.time()
    samples = scrape(own_proxy)
    assert value(samples, "tracetap_paused") == 1
    started = value(samples, "tracetap_pause_start_time_seconds")
    assert before <= started <= after
    # A second pause while paused does not restart the clock.
    assert own_proxy.admin("POST", "/tracetap/pause", {"wait": False})[0] == 200
    assert value(scrape(own_proxy), "tracetap_pause_start_time_seconds") == started
    assert own_proxy.admin("POST", "/tracetap/resume", {})[0] == 200
    samples = scrape(own_proxy)
    assert value(samples, "tracetap_paused") == 0
    assert value(samples, "tracetap_pause_start_time_seconds") == 0

    for episode, body in [("e1", {"reward": 0.5}), ("e2", {"reward": 1.5}), ("e3", {})]:
        assert own_proxy.admin("POST", "/tracetap/episodes", {"id": episode})[0] == 201
        assert own_proxy.admin("POST", f"/tracetap/episodes/{episode}/finish", body)[0] == 200
    samples = admin_scrape(own_proxy)
    assert value(samples, "tracetap_episodes_finished_total") == 3
    assert value(samples, "tracetap_episode_reward_count") == 2  # e3 reported none
    assert value(samples, "tracetap_episode_reward_sum") == 2.0
    # The open page counts the episodes but grades none of them.
    samples = scrape(own_proxy)
    assert value(samples, "tracetap_episodes_finished_total") == 3
    assert not {name for name, _ in samples if "reward" in name or "integrity" in name}


def _plain_upstream() -> web.Application:
    """An OpenAI-like server that returns neither token ids nor logprobs."""
    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": body["model"],
            "choices": [{"index": i, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": f"answer {i}"}}
                        for i in range(body.get("n", 1))],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        })

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


def test_choices_without_token_ids_or_logprobs_are_counted(loop_thread, serve_app, tmp_path):
    settings = Settings(upstream=serve_app(_plain_upstream()) + "/v1",
                        db=f"sqlite:///{tmp_path / 'db.sqlite'}", data_dir=str(tmp_path / "data"),
                        port=free_port())
    upgrade(settings.db)
    proxy = Proxy(loop_thread, settings).start()
    try:
        client = openai.OpenAI(base_url=proxy.episode_url("plain"), api_key="x")
        with client:
            client.chat.completions.create(model="m", messages=MESSAGES, n=3)
        proxy.flush()  # counted by the writer, once the engine's tokenizer was tried
        samples = settled(proxy)
    finally:
        proxy.stop()
    assert value(samples, "tracetap_choices_total") == 3
    assert value(samples, "tracetap_token_ids_missing_total", reason="no_tokenizer") == 3
    assert value(samples, "tracetap_logprobs_missing_total") == 3


def _start(loop_thread: LoopThread, engine_url: str, db: str, data_dir: Path) -> Proxy:
    return Proxy(loop_thread, Settings(upstream=engine_url, db=db, data_dir=str(data_dir),
                                       port=free_port())).start()


def test_database_outage_then_a_restart_with_a_journal(loop_thread, engine, tmp_path):
    db, data_dir = f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "data"
    # No schema yet: every write fails, as with a database that is down.
    first = _start(loop_thread, engine.url, db, data_dir)
    try:
        client = openai.OpenAI(base_url=first.episode_url("outage"), api_key="x")
        with client:
            client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=3)
        deadline = time.monotonic() + 10
        while value(samples := scrape(first), "tracetap_db_writes_ok") != 0:
            assert time.monotonic() < deadline, "the writer never reported the failure"
            time.sleep(0.02)  # polling the writer's retry loop
        assert value(samples, "tracetap_db_write_errors_total") >= 1
        assert value(samples, "tracetap_records_total", outcome="spilled") == 1
        assert value(samples, "tracetap_journal_bytes") > 0
        assert value(samples, "tracetap_journal_recovered_bytes") == 0
    finally:
        first.stop()  # the record stays in the journal
    left = sum(p.stat().st_size for p in data_dir.rglob("*.seg"))
    assert left > 0

    upgrade(db)
    started = time.time()
    second = _start(loop_thread, engine.url, db, data_dir)
    try:
        samples = scrape(second)
        assert value(samples, "tracetap_journal_recovered_bytes") == left
        assert started <= value(samples, "tracetap_start_time_seconds") <= time.time()
        assert value(samples, "tracetap_db_writes_ok") == 1
        second.flush()
        samples = scrape(second)
        assert value(samples, "tracetap_records_total", outcome="replayed") == 1
        assert value(samples, "tracetap_journal_bytes") == 0
        assert value(samples, "tracetap_journal_recovered_bytes") == left  # still says so
    finally:
        second.stop()


def test_upstream_health_follows_the_upstream(loop_thread, tmp_path):
    port = free_port()
    upstream = f"http://127.0.0.1:{port}/v1"
    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(db)
    proxy = _start(loop_thread, upstream, db, tmp_path / "data")
    labels = {"upstream": upstream}
    engine = EngineServer(port=port)
    try:
        assert value(scrape(proxy), "tracetap_upstream_healthy", **labels) == 1
        body = {"model": "mock-model", "messages": MESSAGES, "max_tokens": 2}
        url = proxy.url + "/v1/chat/completions"
        assert post(url, body)[0] == 502  # nothing listens there yet
        assert value(scrape(proxy), "tracetap_upstream_healthy", **labels) == 0
        loop_thread.run(engine.start())
        # One upstream, so no background probe: the next call that gets through is the proof.
        assert post(url, body)[0] == 200
        assert value(scrape(proxy), "tracetap_upstream_healthy", **labels) == 1
    finally:
        proxy.stop()
        loop_thread.run(engine.close())
