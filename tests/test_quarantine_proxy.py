"""Through the running proxy with the real openai SDK: an agent's hostile requests (token
ids no database column holds, NUL characters, a 300-character model name) do not stop
the capture of anyone else's calls; each is stored altered or kept in the dead-letter
file, and ``tracetap quarantine`` shows it."""

from __future__ import annotations

import json
import re
import signal

import openai
import pytest
from helpers.http import fetch, metrics_text, post
from helpers.loop import free_port, wait_until
from helpers.servers import Forwarder, stored_calls

from tracetap.cli import main
from tracetap.migrations import upgrade
from tracetap.storage.quarantine import read_all
from tracetap.storage.storable import MARK

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def clients():
    """openai clients, closed at the end (each holds a connection pool)."""
    made: list[openai.OpenAI] = []
    yield made
    for client in made:
        client.close()


def _client(made: list, proxy, episode: str) -> openai.OpenAI:
    made.append(openai.OpenAI(base_url=proxy.episode_url(episode), api_key="x",
                              max_retries=0))
    return made[-1]


def test_hostile_requests_never_stop_capture_of_other_episodes(proxy, clients, capsys):
    hostile = _client(clients, proxy, "hostile")
    # A legacy completions prompt of ids outside int32: the engine rejects it, and the
    # ids are all the call has (SQLite and Postgres both refused this batch for ever).
    with pytest.raises(openai.BadRequestError):
        hostile.completions.create(model="mock", prompt=[1, 2**40, 3], max_tokens=4)
    # "\u0000" in JSON strings is a NUL in the model column (Postgres refuses it).
    # (The mock engine serves any model name; a real one answers 404: captured the same.)
    hostile.chat.completions.create(model="mock\u0000", messages=MESSAGES, max_tokens=4)
    hostile.chat.completions.create(model="m" * 300, messages=MESSAGES, max_tokens=4)
    hostile.chat.completions.create(
        model="mock", messages=[{"role": "user", "content": "a\u0000b"}], max_tokens=4)
    # A raw NUL byte in the body (not JSON's escape): the request text holds a NUL.
    # Refused as invalid JSON, and stored as such.
    post(proxy.episode_url("hostile") + "/chat/completions",
         b'{"model": "mock", "max_tokens": 4, "messages": [{"role": "user", '
         b'"content": "raw\x00nul"}]}')
    normal = _client(clients, proxy, "normal")
    for _ in range(10):
        reply = normal.chat.completions.create(model="mock", messages=MESSAGES, max_tokens=4,
                                               logprobs=True)
        assert reply.choices[0].message.content

    calls = proxy.calls("normal")
    assert len(calls) == 10 and all(c["prompt_ids"] for c in calls)
    stored = proxy.calls("hostile")
    assert len(stored) == 5  # the hostile calls too: altered where they had to be
    by_model = {c["model"]: c for c in stored}
    ids_call = next(c for c in stored if c["endpoint"] == "completions")
    assert ids_call["prompt_ids"] is None and MARK in ids_call["error"]
    assert ids_call["http_status"] == 400
    postgres = proxy.state.engine.dialect.name == "postgresql"
    entries = {e.call_id: e for e in read_all(proxy.settings.data_dir)}
    for call in stored:
        altered = call["error"] is not None and MARK in call["error"]
        assert (call["call_id"] in entries) == altered
        if altered:  # the dead-letter file keeps the record as captured
            assert entries[call["call_id"]].kind == "altered"
    if postgres:
        assert "mock\ufffd" in by_model and "m" * 256 in by_model
        assert len(entries) == 3
        # Request bodies are stored as blocks of bytes (each token stored once): the raw
        # NUL is kept as captured, with nothing to alter.
        nul = next(c for c in stored if "raw" in (c["request"] or ""))
        assert "raw\x00nul" in nul["request"] and MARK not in nul["error"]
        content = next(c for c in stored if c["model"] == "mock" and c is not ids_call)["request"]
        assert "a\\u0000b" in content  # the request's JSON escape, as the SDK sent it
    else:
        assert "mock\x00" in by_model and "m" * 300 in by_model
        assert len(entries) == 1
    metrics = proxy.state.metrics
    assert metrics.records_total.labels("altered")._value.get() == len(entries)
    assert metrics.records_total.labels("quarantined")._value.get() == 0

    # The viewer's list page counts them and says where they are.
    status, page = fetch("GET", proxy.url + "/tracetap/ui/", headers={"Accept": "text/html"},
                         token=proxy.admin_token)
    assert status == 200, page
    body = page.decode()
    refused_text = "0 call records refused by the database (not stored)"
    assert f"{refused_text} and {len(entries)} stored altered are kept in" in body

    # The CLI lists them with their reason, and shows one whole.
    listed = _cli(capsys, "quarantine", "list", "--data-dir", proxy.settings.data_dir)
    assert listed.count("altered") >= len(entries) and "hostile" in listed
    assert "outside int32" in listed
    shown = json.loads(_cli(capsys, "quarantine", "show", ids_call["call_id"], "--data-dir",
                            proxy.settings.data_dir))
    assert shown["kind"] == "altered" and shown["record"]["prompt_ids"] == [1, 2**40, 3]


def _cli(capsys, *args: str) -> str:
    capsys.readouterr()
    assert main(list(args)) == 0
    return capsys.readouterr().out


def test_poison_journaled_before_a_sigkill_is_split_out_on_the_replay(
        engine, fresh_postgres, run_proxy, loop_thread, tmp_path, clients):
    """The database is out while an agent sends hostile requests among normal calls of
    another episode, so all of them are only in the journal when the proxy is SIGKILLed;
    the next process replays that journal: the outage quarantined nothing, the replay
    stores every normal call, the hostile ones altered or quarantined, each counted."""
    upgrade(fresh_postgres)
    forwarder = Forwarder(loop_thread, free_port())
    forwarder.start()
    try:
        _outage_kill_replay(forwarder, engine, fresh_postgres, run_proxy, tmp_path, clients)
    finally:
        forwarder.cut()


def _outage_kill_replay(forwarder, engine, fresh_postgres, run_proxy, tmp_path, clients):
    data_dir = tmp_path / "data"
    proxy = run_proxy(engine.url, forwarder.route(fresh_postgres), data_dir=data_dir)
    forwarder.cut()
    hostile = _client(clients, proxy, "hostile")
    with pytest.raises(openai.BadRequestError):
        hostile.completions.create(model="mock", prompt=[1, 2**40, 3], max_tokens=4)
    hostile.chat.completions.create(model="mock\u0000", messages=MESSAGES, max_tokens=4)
    # An id this long is refused by Postgres and never shortened: only a relayed path
    # takes it today, so it is sent the way a relayed route would store it.
    long_episode = "e" * 300
    normal = _client(clients, proxy, "normal")
    for i in range(20):
        normal.chat.completions.create(model="mock", max_tokens=4,
                                       messages=[{"role": "user", "content": f"n{i}"}])
    wait_until(lambda: _metric(proxy.url, "tracetap_capture_queue_depth") == 22,
                "every call journaled")
    proxy.signal(signal.SIGKILL)
    assert proxy.wait() == -signal.SIGKILL
    assert read_all(data_dir) == []  # an outage is never a refusal
    # A record of an episode id Postgres cannot hold, left in the journal by a process
    # that wrote it (as a relayed path does today): replayed with the others.
    _journal_one(data_dir, long_episode)
    forwarder.start()

    restarted = run_proxy(engine.url, forwarder.route(fresh_postgres), data_dir=data_dir)
    wait_until(lambda: _metric(restarted.url, "tracetap_capture_queue_depth") == 0
                and not list((data_dir / "journal").glob("*.seg")), "the replay")
    contents = sorted(json.loads(c["request"])["messages"][0]["content"]
                      for c in stored_calls(fresh_postgres, "normal"))
    assert contents == sorted(f"n{i}" for i in range(20))
    stored = stored_calls(fresh_postgres, "hostile")
    assert len(stored) == 2 and all(MARK in c["error"] for c in stored)
    entries = read_all(data_dir)
    assert sorted(e.kind for e in entries) == ["altered", "altered", "refused"]
    [refused] = [e for e in entries if e.kind == "refused"]
    assert refused.episode_id == long_episode and "StringDataRightTruncation" in refused.reason
    outcomes = dict(re.findall(r'^tracetap_records_total\{outcome="(\w+)"\} (\S+)$',
                               metrics_text(restarted.url), re.MULTILINE))
    assert float(outcomes["quarantined"]) == 1 and float(outcomes["altered"]) == 2
    assert float(outcomes["replayed"]) == 22  # every record but the refused one
    restarted.stop()  # before the forwarder goes: it exits with an empty journal


def _journal_one(data_dir, episode_id: str) -> None:
    from tracetap.proxy.episodes.ids import uuid7
    from tracetap.storage.journal import Journal
    from tracetap.storage.records import CallRecord
    from tracetap.storage.writer import Writer

    journal = Journal(data_dir / "journal", max_bytes=1 << 20)
    journal.append(Writer.encode(CallRecord(call_id=uuid7(), episode_id=episode_id,
                                            endpoint="chat.completions", t_start=1.0)))
    journal.close()


def _metric(url: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", metrics_text(url), re.MULTILINE)
    return float(found.group(1)) if found else -1.0
