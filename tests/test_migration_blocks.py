"""Revision 0007 (blocks): a database written by revision 0006 upgrades without losing a
byte, and the export of the same calls is byte-identical whichever layout holds them."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text

from tests.test_dedup import _run, _same, conversation
from tracetap.exporters import export
from tracetap.migrations import upgrade
from tracetap.storage import queries
from tracetap.storage.footprint import stored_ids
from tracetap.storage.records import CallRecord
from tracetap.storage.rows import call_row, choice_rows, episode_rows, insert_calls

_NEW = {"prompt_refs", "request_refs", "upstream_request_refs", "response_refs", "text_refs",
        "completion_ids_refs", "completion_logprobs_refs"}  # columns revision 0007 added


@pytest.fixture(params=["sqlite", "postgres"])
def bare_url(request, tmp_path: Path) -> str:
    """An empty database of each kind, not migrated."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'old.db'}"
    return request.getfixturevalue("fresh_postgres")


_LATER = {"registered_at",  # added by revisions after 0007
          "lineage", "parent_lineage", "conversation", "parent_id",
          "policy_spans", "routed_experts_refs"}


async def _insert(conn, table: str, rows: list[dict]) -> None:
    for row in rows:
        row = {k: v for k, v in row.items() if k not in _NEW | _LATER}
        names = ", ".join(f'"{k}"' for k in row)
        values = ", ".join(f":{k}" for k in row)
        await conn.execute(text(f'INSERT INTO "{table}" ({names}) VALUES ({values})'), row)


def write_as_0006(url: str, records: list[CallRecord]) -> None:
    """The rows revision 0006's writer stored: prompt ids and bodies inline in each call."""
    upgrade(url, "0006")

    async def step(engine):
        async with engine.begin() as conn:
            await _insert(conn, "episodes", episode_rows(records))
            await _insert(conn, "calls", [call_row(r, 1.0) for r in records])
            await _insert(conn, "choices", [row for r in records for row in choice_rows(r)])

    _run(url, step)


def _records() -> list[CallRecord]:
    return [*conversation("old-a", 4, seed=3, n=2), *conversation("old-b", 3, seed=4)]


def test_a_0006_database_upgrades_and_reads_back_every_call_as_it_was(bare_url):
    records = _records()
    write_as_0006(bare_url, records)
    upgrade(bare_url)
    later = conversation("old-a", 6, seed=3, n=2)[4:]  # the conversation goes on

    async def step(engine):
        await insert_calls(engine, later)
        return {e: await queries.calls_of(engine, e) for e in ("old-a", "old-b")}

    stored = _run(bare_url, step)
    got = {c["call_id"]: c for calls in stored.values() for c in calls}
    assert set(got) == {r.call_id for r in [*records, *later]}
    for record in [*records, *later]:
        _same(got[record.call_id], record)


def _finish(url: str) -> None:
    async def step(engine):
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE episodes SET finished_at = 5000.0, reward = 1.0"))

    _run(url, step)


def _files(out: Path) -> dict[str, bytes]:
    """The export's data files by dataset and order (names carry the run's time)."""
    found = {}
    for dataset in ("calls", "trajectories"):
        for i, path in enumerate(sorted((out / dataset).rglob("*.parquet"))):
            found[f"{dataset}/{i}"] = path.read_bytes()
    return found


def test_the_export_is_byte_identical_from_either_layout(bare_url, tmp_path):
    records = _records()
    write_as_0006(bare_url, records)
    upgrade(bare_url)
    _finish(bare_url)
    fresh = f"sqlite:///{tmp_path / 'new.db'}"
    upgrade(fresh)
    _run(fresh, lambda engine: insert_calls(engine, records))
    _finish(fresh)

    old_files = (export(bare_url, tmp_path / "old"), _files(tmp_path / "old"))[1]
    new_files = (export(fresh, tmp_path / "new"), _files(tmp_path / "new"))[1]
    assert set(old_files) == {"calls/0", "trajectories/0"}
    assert old_files == new_files


def test_the_stored_id_count_reads_ids_kept_inline_by_an_upgraded_database(bare_url):
    """Rows written before blocks keep their ids inline: the footprint counts them (each
    row's own, as stored), and the calls written after the upgrade in blocks besides."""
    records = _records()
    write_as_0006(bare_url, records)
    upgrade(bare_url)
    held = _run(bare_url, stored_ids)
    assert held.prompt == sum(len(r.prompt_ids) for r in records)
    assert held.completion == sum(len(c.completion_ids) for r in records for c in r.choices)
    later = conversation("old-a", 6, seed=3, n=2)[4:]
    _run(bare_url, lambda engine: insert_calls(engine, later))
    after = _run(bare_url, stored_ids)
    assert after.prompt > held.prompt and after.completion > held.completion
