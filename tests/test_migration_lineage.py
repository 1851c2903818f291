"""Revision 0010 (lineages): a database written by revision 0008 upgrades with its data
as it was, and exports as before: one lineage per episode, a verdict from its calls."""

from __future__ import annotations

import pyarrow.parquet as pq
from sqlalchemy import text

from tests.test_dedup import _run, conversation
from tests.test_migration_blocks import _insert, bare_url  # noqa: F401 (a fixture)
from tracetap.exporters import export
from tracetap.migrations import upgrade
from tracetap.storage.rows import call_row, choice_rows, episode_rows


def test_a_0008_database_upgrades_and_exports_one_lineage_per_episode(bare_url, tmp_path):  # noqa: F811
    records = conversation("old", 3, seed=5)
    records[-1].status, records[-1].http_status = "upstream_timeout", 504
    upgrade(bare_url, "0008")

    async def write(engine):
        async with engine.begin() as conn:
            await _insert(conn, "episodes", episode_rows(records))
            await _insert(conn, "calls", [call_row(r, 1.0) for r in records])
            await _insert(conn, "choices", [row for r in records for row in choice_rows(r)])
            await conn.execute(text("UPDATE episodes SET finished_at = 5000.0, reward = 0.0"))

    _run(bare_url, write)
    upgrade(bare_url)
    export(bare_url, tmp_path / "out")
    calls = pq.read_table(tmp_path / "out" / "calls").to_pylist()
    assert {c["call_id"] for c in calls} == {r.call_id for r in records}
    assert {c["lineage_id"] for c in calls} == {records[0].call_id}
    assert {c["parent_lineage_id"] for c in calls} == {None}
    [row] = pq.read_table(tmp_path / "out" / "trajectories").to_pylist()
    assert row["split_reason"] is None and row["lineage_id"] == records[0].call_id
    assert (row["integrity"], row["integrity_causes"]) == (
        "infra", [{"cause": "upstream_timeout", "calls": 1}])
