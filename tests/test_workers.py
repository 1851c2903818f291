"""`tracetap serve --workers 2`: two processes on one port, as one proxy (real processes).

Which process answered is read from the X-Tracetap-Worker header ("index:pid"); each
agent call uses a new SDK client, so a new connection, which the kernel gives to either.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
from helpers.http import metrics_text
from helpers.loop import wait_until
from helpers.servers import stored_calls
from prometheus_client.parser import text_string_to_metric_families

from tracetap.migrations import upgrade
from tracetap.proxy.server.app import WORKER_HEADER

TRIES = 60  # calls it may take the kernel to hand connections to both workers


def _agent_call(proxy, content: str, *, stream: bool = False, **extra) -> tuple[str | None, object]:
    """One agent call on a new connection: (the worker that answered, the reply or the
    APIStatusError); (None, the error) when no worker answered (one was just killed)."""
    client = openai.OpenAI(base_url=proxy.episode_url("w"), api_key="x", max_retries=0, timeout=60)
    with client:
        try:
            raw = client.chat.completions.with_raw_response.create(
                model="mock-model",
                messages=[{"role": "user", "content": content}],
                max_tokens=8,
                stream=stream,
                extra_body=extra or None,
            )
            reply = list(raw.parse()) if stream else raw.parse()
        except openai.APIStatusError as error:
            return error.response.headers[WORKER_HEADER], error
        except openai.APIConnectionError as error:
            return None, error
        return raw.headers[WORKER_HEADER], reply


def _until_both(proxy, prefix: str, keep=lambda reply: True) -> dict[str, list]:
    """Calls (8 at a time) until both workers gave a reply that ``keep`` accepts;
    {worker: [(content, reply), ...]} of every call made."""
    seen: dict[str, list] = {}
    with ThreadPoolExecutor(8) as pool:
        for batch in range(0, TRIES, 8):
            contents = [f"{prefix}-{i}" for i in range(batch, batch + 8)]
            for content, (worker, reply) in zip(
                contents, pool.map(lambda c: _agent_call(proxy, c), contents), strict=True
            ):
                if worker is not None:
                    seen.setdefault(worker, []).append((content, reply))
            kept = {w for w, replies in seen.items() if any(keep(r) for _, r in replies)}
            if len({w.split(":")[0] for w in kept}) == 2:
                return seen
    raise AssertionError(f"not both workers within {TRIES} calls: {sorted(seen)}")


def _index(worker: str) -> str:
    return worker.split(":")[0]


def _metrics(proxy) -> dict[tuple[str, frozenset], float]:
    text = metrics_text(proxy.url)
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _requests(samples, code: str) -> float:
    return samples.get(
        ("tracetap_requests_total", frozenset({"route": "chat_completions", "code": code}.items())),
        0.0,
    )


def _stamped(calls: list[dict]) -> dict[str, str | None]:
    return {json.loads(c["request"])["messages"][0]["content"]: c["policy_version"] for c in calls}


def test_two_workers_share_pause_policy_metrics_and_drain_on_sigterm(
    engine, fresh_postgres, run_proxy, tmp_path
):
    upgrade(fresh_postgres)
    args = ("--workers", "2", "--pause-timeout", "1", "--drain-timeout", "20")
    proxy = run_proxy(engine.url, fresh_postgres, *args)
    ok = lambda reply: not isinstance(reply, openai.APIError)  # noqa: E731
    served = _until_both(proxy, "first", ok)
    assert len({_index(w) for w in served}) == 2 and len(served) == 2  # two pids

    # A pause reaches both: each answers 503 once its held call waits out --pause-timeout.
    status, paused = proxy.admin("POST", "/tracetap/pause", {"timeout": 30})
    assert status == 200 and paused["drained"] is True
    refused = _until_both(proxy, "held", lambda r: getattr(r, "status_code", 0) == 503)
    assert all(
        getattr(r, "status_code", 0) == 503 for replies in refused.values() for _, r in replies
    )
    # Resumed through one worker, with a version: both serve again, and stamp it.
    assert proxy.admin("POST", "/tracetap/resume", {"policy_version": "v2"})[0] == 200
    after = _until_both(proxy, "after", ok)
    stamped = _stamped(stored_calls_now(proxy, fresh_postgres, after))
    assert set(stamped.values()) == {"v2"}

    # /metrics, scraped from either worker, counts every call of both.
    answered = sum(len(r) for r in (*served.values(), *refused.values(), *after.values()))

    def counted():  # a call is counted just after its reply is sent
        samples = _metrics(proxy)
        return (
            samples if _requests(samples, "200") + _requests(samples, "503") == answered else None
        )

    samples = wait_until(counted, timeout=30, what="the metrics of every call")
    assert _requests(samples, "503") == sum(len(r) for r in refused.values())

    # PUT /tracetap/policy reaches the other worker within its poll interval.
    assert proxy.admin("PUT", "/tracetap/policy", {"version": "v3"})[0] == 200
    for attempt in range(20):
        latest = _until_both(proxy, f"v3-{attempt}", ok)
        stamped = _stamped(stored_calls_now(proxy, fresh_postgres, latest))
        if {
            _index(w)
            for w, replies in latest.items()
            if any(stamped[c] == "v3" for c, _ in replies)
        } == {"0", "1"}:
            break
    else:
        raise AssertionError("a worker never stamped the new policy version")

    # SIGTERM to the supervisor: streams in flight on both workers finish and are stored.
    started = threading.Barrier(9)

    def stream(i: int):
        client = openai.OpenAI(base_url=proxy.episode_url("drain"), api_key="x", max_retries=0)
        with client:
            raw = client.chat.completions.with_raw_response.create(
                model="mock-model",
                messages=[{"role": "user", "content": f"s{i}"}],
                stream=True,
                extra_body={"mock_completion_tokens": 40, "mock_chunk_delay_s": 0.03},
            )
            chunks = []
            for chunk in raw.parse():
                if not chunks:
                    started.wait(30)
                chunks.append(chunk)
            return raw.headers[WORKER_HEADER], chunks

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(stream, i) for i in range(8)]
        started.wait(30)
        proxy.signal(signal.SIGTERM)
        results = [f.result(60) for f in futures]
    assert proxy.wait(60) == 0
    assert all(chunks[-1].choices[0].finish_reason == "stop" for _, chunks in results)
    drained = stored_calls(fresh_postgres, "drain")
    assert len(drained) == 8 and all(
        c["status"] == "ok" and len(c["choices"][0]["completion_ids"]) == 40 for c in drained
    )

    # The policy version outlives serve: both workers of the next run stamp v3 at once.
    again = run_proxy(engine.url, fresh_postgres, *args)
    restarted = _until_both(again, "restarted", ok)
    assert set(_stamped(stored_calls_now(again, fresh_postgres, restarted)).values()) == {"v3"}


def stored_calls_now(proxy, db: str, made: dict[str, list]) -> list[dict]:
    """The stored rows of calls just made (each worker commits within ~50 ms)."""
    contents = {content for replies in made.values() for content, _ in replies}

    def stored():
        calls = [
            c
            for c in stored_calls(db, "w")
            if json.loads(c["request"])["messages"][0]["content"] in contents
        ]
        return calls if len(calls) == len(contents) else None

    return wait_until(stored, timeout=30, what="the calls to be stored")


def test_a_killed_worker_is_restarted_and_its_completed_calls_stored_once(
    engine, fresh_postgres, run_proxy, tmp_path
):
    upgrade(fresh_postgres)
    proxy = run_proxy(engine.url, fresh_postgres, "--workers", "2")
    completed: dict[str, str] = {}  # content -> worker
    killed = threading.Event()
    victim: list[str] = []

    def agent(i: int) -> None:
        worker, reply = _agent_call(proxy, f"call-{i}", stream=i % 2 == 0)
        if worker is None or isinstance(reply, openai.APIError):
            return  # the worker died under this call: it did not complete for the client
        completed[f"call-{i}"] = worker
        on_one = [w for w in completed.values() if _index(w) == "1"]
        if len(on_one) >= 6 and not killed.is_set():
            killed.set()
            victim.append(on_one[0])
            os.kill(int(on_one[0].split(":")[1]), signal.SIGKILL)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(agent, range(48)))
    assert killed.is_set()
    # The supervisor starts worker 1 again; it replays its journal, and serves. Until it
    # listens the kernel hands every connection to worker 0 (on a loaded machine its
    # start takes longer than _until_both's calls), so wait for it to say it serves.
    wait_until(lambda: "worker 1 serves again" in proxy.log.read_text(),
               "the supervisor to restart worker 1", timeout=60)
    revived = _until_both(proxy, "revived", lambda r: not isinstance(r, openai.APIError))
    assert any(_index(w) == "1" and w != victim[0] for w in revived)

    def all_stored():
        # A stream the kill cut (never complete for its client) is a record_lost
        # tombstone, without a request: the worker admitted it and never journaled it.
        contents = [
            json.loads(c["request"])["messages"][0]["content"]
            for c in stored_calls(fresh_postgres, "w") if c["status"] != "record_lost"
        ]
        return contents if set(completed) <= set(contents) else None

    contents = wait_until(all_stored, timeout=30, what="every completed call to be stored")
    assert len(contents) == len(set(contents)), "a call was stored twice"
    assert sum(_index(w) == "1" for w in completed.values()) >= 6
    assert "worker 1 serves again" in proxy.log.read_text()
    proxy.signal(signal.SIGTERM)
    assert proxy.wait(60) == 0


def test_workers_stop_by_themselves_when_their_supervisor_is_killed(
    engine, fresh_postgres, run_proxy
):
    """A supervisor killed outright cannot stop its workers: the kernel tells each one
    (Linux: the parent-death signal, no timer in an idle worker) and it stops gracefully,
    saying why."""
    upgrade(fresh_postgres)
    proxy = run_proxy(engine.url, fresh_postgres, "--workers", "2")
    pids = {int(w.split(":")[1]) for w in _until_both(proxy, "orphan")}
    proxy.signal(signal.SIGKILL)

    def stopped(pid: int) -> bool:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            state = status.split("State:")[1].split()[0]
        except (FileNotFoundError, IndexError):
            return True
        return state == "Z"  # exited; a container's init may not reap it

    wait_until(lambda: all(stopped(pid) for pid in pids), "the workers to stop",
               timeout=30)
    assert proxy.log.read_text().count("is gone; stopping") == 2
