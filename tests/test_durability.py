"""Nothing captured is lost: database outage, SIGKILL, SIGTERM drain (real processes)."""

from __future__ import annotations

import json
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
from helpers.http import get, metrics_text
from helpers.loop import free_port, wait_until
from helpers.servers import Forwarder, stored_calls

from tracetap.migrations import upgrade


def _ask(base_url: str, i: int, stream: bool) -> bool:
    """One agent call; True when the client received the complete answer."""
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=30)
    with client:
        messages = [{"role": "user", "content": f"call-{i}"}]
        if stream:
            chunks = list(client.chat.completions.create(
                model="mock-model", messages=messages, max_tokens=16, stream=True))
            return any(c.choices and c.choices[0].finish_reason for c in chunks)
        reply = client.chat.completions.create(model="mock-model", messages=messages,
                                               max_tokens=16)
        return reply.choices[0].finish_reason is not None


def _contents(calls: list[dict]) -> list[str]:
    return [json.loads(c["request"])["messages"][0]["content"] for c in calls]


def _backlog(url: str) -> int:
    status, ready = get(url + "/readyz", timeout=5)
    assert status in (200, 503), ready
    return ready["journal"]["bytes"]


def test_sigkill_then_restart_recovers_every_completed_call(engine, db_url, run_proxy, tmp_path):
    data_dir = tmp_path / "data"
    proxy = run_proxy(engine.url, db_url, data_dir=data_dir)
    completed: list[int] = []
    killed = threading.Event()

    def agent(i: int) -> None:
        if killed.is_set():
            return
        try:
            if _ask(proxy.episode_url("kill9"), i, stream=i % 2 == 0):
                completed.append(i)
        except openai.APIError:
            pass  # the proxy died under this call: it did not complete for the client
        if len(completed) >= 50 and not killed.is_set():
            killed.set()
            proxy.signal(signal.SIGKILL)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(agent, range(100)))
    assert killed.is_set() and proxy.wait() == -signal.SIGKILL

    restarted = run_proxy(engine.url, db_url, data_dir=data_dir)
    wait_until(lambda: _backlog(restarted.url) == 0, "journal replay", 30)
    contents = _contents(stored_calls(db_url, "kill9"))
    assert len(contents) == len(set(contents)), "a call was stored twice"
    missing = {f"call-{i}" for i in completed} - set(contents)
    assert not missing, f"completed calls lost: {sorted(missing)}"
    # A kill is expected: the journal's cut tail is no warning, and the start says what it
    # replayed (when the kill left records behind).
    log = restarted.log.read_text()
    assert "WARNING tracetap.journal" not in log, log
    if "left by the previous process; writing them" in log:
        assert re.search(r"journal: replayed \d+ records left by the previous process", log)


def test_sigterm_drains_streams_in_flight_and_exits_zero(engine, fresh_postgres, run_proxy):
    upgrade(fresh_postgres)
    proxy = run_proxy(engine.url, fresh_postgres, "--drain-timeout", "20")
    started = threading.Barrier(9)

    def stream(i: int):
        client = openai.OpenAI(base_url=proxy.episode_url("drain"), api_key="x", max_retries=0)
        with client:
            chunks = client.chat.completions.create(
                model="mock-model", messages=[{"role": "user", "content": f"s{i}"}],
                stream=True, extra_body={"mock_completion_tokens": 40,
                                         "mock_chunk_delay_s": 0.03})
            out = []
            for chunk in chunks:
                if not out:
                    started.wait(10)
                out.append(chunk)
            return out

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(stream, i) for i in range(8)]
        started.wait(10)
        proxy.signal(signal.SIGTERM)
        results = [f.result(30) for f in futures]
    assert proxy.wait(30) == 0
    for chunks in results:
        assert chunks[-1].choices[0].finish_reason == "stop"
    calls = stored_calls(fresh_postgres, "drain")
    assert len(calls) == 8
    assert all(c["status"] == "ok" and len(c["choices"][0]["completion_ids"]) == 40
               for c in calls)


def test_database_outage_loses_nothing_and_never_reaches_the_agent(
        engine, fresh_postgres, run_proxy, loop_thread):
    upgrade(fresh_postgres)
    forwarder = Forwarder(loop_thread, free_port())
    forwarder.start()
    via_forwarder = forwarder.route(fresh_postgres)
    proxy = run_proxy(engine.url, via_forwarder)
    errors: list[Exception] = []
    done = []
    lock = threading.Lock()

    def agent(i: int) -> None:
        try:
            assert _ask(proxy.episode_url("outage"), i, stream=i % 3 == 0)
        except Exception as exc:
            errors.append(exc)
        with lock:
            done.append(i)
            if len(done) == 60:
                forwarder.cut()
            if len(done) == 150:
                assert _backlog(proxy.url) > 0  # records are waiting in the journal
                forwarder.start()

    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(agent, range(200)))
        assert errors == []
        wait_until(lambda: _backlog(proxy.url) == 0, "journal to drain after the outage", 60)
        contents = _contents(stored_calls(fresh_postgres, "outage"))
        assert sorted(contents) == sorted(f"call-{i}" for i in range(200))
        metrics = metrics_text(proxy.url)
        outcomes = dict(re.findall(r'^tracetap_records_total\{outcome="(\w+)"\} (\S+)$',
                                   metrics, re.MULTILINE))
        assert float(outcomes["dropped"]) == 0
        # The outage was seen (records spilled to the journal) and every spilled record
        # was replayed; together with those written directly, each call once.
        assert float(outcomes["spilled"]) > 0
        assert float(outcomes["replayed"]) == float(outcomes["spilled"])
        assert float(outcomes["written"]) + float(outcomes["replayed"]) == 200
    finally:
        proxy.stop()
        forwarder.cut()
