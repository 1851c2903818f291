"""The reward trust verdict (storage.integrity): computed from the stored calls, exported
in both datasets, left out by --exclude-infra, counted at the finish (/metrics), shown in
the viewer; tombstones for records that could not be stored (storage.tombstones)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import NamedTuple

import openai
import pyarrow.parquet as pq
import pytest
from helpers.chat_upstreams import scripted_chat_app
from helpers.http import admin_metrics_text, fetch
from helpers.loop import free_port
from helpers.servers import Proxy
from sqlalchemy import text

from tracetap import cli
from tracetap.exporters import export
from tracetap.migrations import upgrade
from tracetap.proxy.runtime.settings import Settings
from tracetap.storage.engine import create_engine
from tracetap.storage.integrity import (
    AGENT_CAUSES,
    CAUSES,
    INFRA_CAUSES,
    cause_of,
    verdicts_of,
)
from tracetap.storage.journal import Journal
from tracetap.storage.records import STATUSES, CallRecord
from tracetap.storage.rows import insert_calls
from tracetap.storage.writer import Writer

DOCS = Path(__file__).resolve().parents[1] / "docs" / "export.md"


class Row(NamedTuple):
    status: str
    http: int
    ids_missing: str | None
    cause: str | None
    integrity: str


def documented() -> list[Row]:
    """docs/export.md's table of every stored status, its cause and verdict."""
    text = DOCS.read_text()
    table = text[text.index("| status | HTTP | ids_missing |"):].split("\n\n")[0]
    rows = []
    for line in table.splitlines()[2:]:
        status, http, missing, cause, integrity = (
            c.strip().strip("`") for c in line.strip("|").split("|")[:5])
        rows.append(Row(status, int(http), missing or None, cause or None, integrity))
    return rows


def test_the_table_covers_every_status_and_cause():
    rows = documented()
    assert {r.status for r in rows} == set(STATUSES)
    assert {r.cause for r in rows} - {None} == set(CAUSES)
    # An agent's cause never makes an episode infra; an infrastructure cause always does.
    for row in rows:
        assert row.integrity == ("infra" if row.cause in INFRA_CAUSES else "clean"), row
    assert not set(AGENT_CAUSES) & set(INFRA_CAUSES)
    assert all(c.startswith("agent_") for c in AGENT_CAUSES)


@pytest.mark.parametrize("row", documented(), ids=lambda r: f"{r.status}-{r.http}-{r.ids_missing}")
def test_a_calls_cause(row):
    assert cause_of(row.status, row.http, row.ids_missing) == row.cause


def _stored_call(n: int, row: Row) -> CallRecord:
    return CallRecord(call_id=f"c-{n}", episode_id=f"e-{n}", endpoint="chat.completions",
                      status=row.status, http_status=row.http, ids_missing=row.ids_missing,
                      t_start=1.0, t_end=2.0, request="{}", model="m")


def test_every_documented_status_gives_its_verdict_on_both_paths(db_url, tmp_path):
    """One episode per row of the table, stored: the database's grouped query
    (storage.integrity.verdicts: the viewer, analysis, the finish metric) and the
    export's reading of the rows (exporters.annotate) both give the documented cause and
    verdict, and a clean episode of only agent failures keeps its causes."""
    rows = documented()
    records = [_stored_call(n, row) for n, row in enumerate(rows)]
    records.append(CallRecord(call_id="mixed-1", episode_id="mixed", endpoint="chat.completions",
                              status="client_disconnected", http_status=200, t_start=1.0,
                              t_end=2.0, request="{}"))
    records.append(CallRecord(call_id="mixed-2", episode_id="mixed", endpoint="chat.completions",
                              status="bad_request", http_status=400, t_start=3.0, t_end=4.0,
                              request="{}"))

    async def store():
        engine = create_engine(db_url)
        try:
            await insert_calls(engine, records)
            async with engine.begin() as conn:
                await conn.execute(text("UPDATE episodes SET finished_at = 5000.0, reward = 0"))
            return await verdicts_of(engine, [r.episode_id for r in records])
        finally:
            await engine.dispose()

    found = asyncio.run(store())
    export(db_url, tmp_path / "out", datasets=["calls"])
    exported = {c["call_id"]: c for c in pq.read_table(tmp_path / "out" / "calls").to_pylist()}
    for n, row in enumerate(rows):
        on_db, on_export = found[f"e-{n}"], exported[f"c-{n}"]
        assert on_db.integrity == row.integrity, row
        assert on_db.causes == ({row.cause: 1} if row.cause else {}), row
        assert (on_export["integrity"], on_export["integrity_cause"]) == (
            row.integrity, row.cause), row
    assert found["mixed"].integrity == "clean"
    assert found["mixed"].causes == {"agent_bad_request": 1, "agent_disconnect": 1}
    assert found["mixed"].describe() == "clean: agent_bad_request (1), agent_disconnect (1)"


def ask(proxy: Proxy, episode: str, text: str = "hi", extra: dict | None = None) -> None:
    client = openai.OpenAI(base_url=proxy.episode_url(episode), api_key="k", max_retries=0)
    client.chat.completions.create(model="mock-model", max_tokens=8, extra_body=extra,
                                   messages=[{"role": "user", "content": text}])


def test_an_exhausted_budget_is_the_agents_and_an_upstream_failure_infra_everywhere(
        proxy, tmp_path, capsys):
    """A budget the agent spent keeps its episode clean (cause agent_budget); an
    upstream's 500 makes its episode infra: at the finish (/metrics), in both datasets,
    and under --exclude-infra."""
    for episode, budget in (("clean", {}), ("starved", {"max_calls": 1}), ("down", {})):
        assert proxy.admin("POST", "/tracetap/episodes",
                           {"id": episode, "budget": budget or None})[0] == 201
    for episode in ("clean", "starved", "down"):
        ask(proxy, episode)
    with pytest.raises(openai.PermissionDeniedError):  # 403: the calls budget is spent
        ask(proxy, "starved", "again")
    with pytest.raises(openai.InternalServerError):
        ask(proxy, "down", "again", {"mock_status": 500})
    for episode in ("clean", "starved", "down"):
        assert proxy.admin("POST", f"/tracetap/episodes/{episode}/finish",
                           {"reward": 1.0})[0] == 200
    metrics = admin_metrics_text(proxy.url, proxy.admin_token)
    db = proxy.settings.db
    assert 'tracetap_episodes_integrity_total{integrity="clean"} 2.0' in metrics
    assert 'tracetap_episodes_integrity_total{integrity="infra"} 1.0' in metrics
    assert 'tracetap_episode_integrity_causes_total{cause="agent_budget"} 1.0' in metrics
    assert 'tracetap_episode_integrity_causes_total{cause="upstream_error"} 1.0' in metrics

    export(db, tmp_path / "all")
    rows = {r["episode_id"]: r for r in pq.read_table(tmp_path / "all" / "trajectories")
            .to_pylist()}
    assert rows["clean"]["integrity"] == "clean" and rows["clean"]["integrity_causes"] == []
    assert rows["starved"]["integrity"] == "clean"
    assert rows["starved"]["integrity_causes"] == [{"cause": "agent_budget", "calls": 1}]
    assert rows["down"]["integrity"] == "infra"
    assert rows["down"]["integrity_causes"] == [{"cause": "upstream_error", "calls": 1}]
    calls = pq.read_table(tmp_path / "all" / "calls").to_pylist()
    starved = sorted((c["status"], c["integrity"], c["integrity_cause"] or "") for c in calls
                     if c["episode_id"] == "starved")
    assert starved == [("budget_exceeded", "clean", "agent_budget"), ("ok", "clean", "")]

    out = tmp_path / "clean-only"
    assert cli.main(["export", "--db", db, "--out", str(out), "--exclude-infra"]) == 0
    assert "left out: 1 episodes with integrity infra" in capsys.readouterr().out
    for dataset in ("calls", "trajectories"):
        assert {r["episode_id"] for r in pq.read_table(out / dataset).to_pylist()} == {
            "clean", "starved"}


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
