"""The reward trust verdict (storage.integrity): computed from the stored calls, exported
in both datasets, left out by --exclude-infra, counted at the finish (/metrics), shown in
the viewer; tombstones for records that could not be stored (storage.tombstones)."""

from __future__ import annotations

import asyncio

import openai
import pyarrow.parquet as pq
import pytest
from helpers.chat_upstreams import scripted_chat_app
from helpers.http import admin_metrics_text, fetch
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap import cli
from tracetap.exporters import export
from tracetap.migrations import upgrade
from tracetap.proxy.settings import Settings
from tracetap.storage.engine import create_engine
from tracetap.storage.integrity import cause_of, verdicts_of
from tracetap.storage.journal import Journal
from tracetap.storage.records import CallRecord
from tracetap.storage.writer import Writer


@pytest.mark.parametrize(("status", "http", "ids_missing", "cause"), [
    ("ok", 200, None, None),
    ("ok", 400, None, None),  # "context too long": the harness's own doing
    ("ok", 503, None, "upstream_error"),
    ("ok", 429, None, "upstream_error"),
    ("ok", 200, "no_tokenizer", "no_token_ids"),
    ("upstream_unreachable", 502, None, "upstream_error"),
    ("upstream_timeout", 504, None, "upstream_timeout"),
    ("bad_request", 400, None, "refused"),
    ("budget_exceeded", 429, None, "budget_exceeded"),
    ("client_disconnected", 200, None, "client_disconnected"),
    ("vetoed", 200, None, None),
    ("passthrough", 200, None, None),
    ("record_dropped", 200, None, "record_dropped"),
])
def test_a_calls_cause(status, http, ids_missing, cause):
    assert cause_of(status, http, ids_missing) == cause


def ask(proxy: Proxy, episode: str, text: str = "hi") -> None:
    client = openai.OpenAI(base_url=proxy.episode_url(episode), api_key="k", max_retries=0)
    client.chat.completions.create(model="mock-model", max_tokens=8,
                                   messages=[{"role": "user", "content": text}])


def test_an_exhausted_budget_makes_an_episode_infra_everywhere(proxy, tmp_path, capsys):
    for episode, budget in (("clean", {}), ("starved", {"max_calls": 1})):
        assert proxy.admin("POST", "/tracetap/episodes",
                           {"id": episode, "budget": budget or None})[0] == 201
        ask(proxy, episode)
    with pytest.raises(openai.PermissionDeniedError):  # 403: the calls budget is spent
        ask(proxy, "starved", "again")
    for episode in ("clean", "starved"):
        assert proxy.admin("POST", f"/tracetap/episodes/{episode}/finish",
                           {"reward": 1.0})[0] == 200
    metrics = admin_metrics_text(proxy.url, proxy.admin_token)
    assert 'tracetap_episodes_integrity_total{integrity="clean"} 1.0' in metrics
    assert 'tracetap_episodes_integrity_total{integrity="infra"} 1.0' in metrics
    assert 'tracetap_episode_integrity_causes_total{cause="budget_exceeded"} 1.0' in metrics

    db = proxy.settings.db
    export(db, tmp_path / "all")
    rows = {r["episode_id"]: r for r in pq.read_table(tmp_path / "all" / "trajectories")
            .to_pylist()}
    assert rows["clean"]["integrity"] == "clean" and rows["clean"]["integrity_causes"] == []
    assert rows["starved"]["integrity"] == "infra"
    assert rows["starved"]["integrity_causes"] == [{"cause": "budget_exceeded", "calls": 1}]
    calls = pq.read_table(tmp_path / "all" / "calls").to_pylist()
    starved = sorted((c["status"], c["integrity"], c["integrity_cause"]) for c in calls
                     if c["episode_id"] == "starved")
    assert starved == [("budget_exceeded", "infra", "budget_exceeded"), ("ok", "infra", None)]

    out = tmp_path / "clean-only"
    assert cli.main(["export", "--db", db, "--out", str(out), "--exclude-infra"]) == 0
    assert "left out: 1 episodes with integrity infra" in capsys.readouterr().out
    assert {r["episode_id"] for r in pq.read_table(out / "calls").to_pylist()} == {"clean"}
    assert {r["episode_id"] for r in pq.read_table(out / "trajectories").to_pylist()} == {
        "clean"}


def test_an_upstream_failure_shows_in_the_viewer(loop_thread, serve_app, tmp_path):
    upstream = serve_app(scripted_chat_app((503, b'{"error": "overloaded"}')))
    db = f"sqlite:///{tmp_path / 't.db'}"
    upgrade(db)
    proxy = Proxy(loop_thread, Settings(upstream=upstream + "/v1", db=db, port=free_port(),
                                        data_dir=str(tmp_path / "data"))).start()
    try:
        with pytest.raises(openai.InternalServerError):
            ask(proxy, "down")
        proxy.flush()
        token = proxy.admin_token
        for path in ("/tracetap/ui/", "/tracetap/ui/episodes/down"):
            status, page = fetch("GET", proxy.url + path, token=token)
            assert status == 200, path
            page = page.decode()
            assert "infra" in page and "upstream_error" in page, path
    finally:
        proxy.stop()


def record(call_id: str, episode: str, request: str = "{}") -> CallRecord:
    return CallRecord(call_id=call_id, episode_id=episode, endpoint="chat.completions",
                      status="ok", http_status=200, t_start=1.0, t_end=2.0, request=request)


def test_records_that_cannot_be_stored_leave_tombstones(db_url, tmp_path):
    """A dropped record (the journal full) and one the database refuses still mark their
    episodes infra: their tombstones are stored."""

    async def go():
        engine = create_engine(db_url)
        journal = Journal(tmp_path / "journal", max_bytes=4096)
        writer = Writer(engine, journal)
        try:
            assert writer.submit(record("c-1", "full", "x" * 1000))
            assert not writer.submit(record("c-2", "full", "x" * 5000))  # over the bound
            refused = record("c-3", "refused")
            refused.seq = None  # a required value missing: both databases refuse it
            writer.submit(refused)
            await writer.flush()
            return await verdicts_of(engine, ["full", "refused"])
        finally:
            await writer.close()
            await engine.dispose()

    found = asyncio.run(go())
    assert found["full"].causes == {"record_dropped": 1}
    assert found["refused"].causes == {"record_quarantined": 1}
