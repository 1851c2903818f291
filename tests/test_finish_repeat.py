"""Finishing an episode again: the same result changes nothing and is not exported again
(a trainer's retried finish); a new result is exported again with a higher finish_seq,
and readers keep the latest with one line (docs/export.md, "Finished again")."""

from __future__ import annotations

import json

import duckdb
import openai
import pyarrow.parquet as pq
from helpers.http import admin_call

from tracetap.exporters import export


def _finish(proxy, episode: str, body: dict) -> dict:
    status, reply = admin_call(proxy.url, "POST", f"/tracetap/episodes/{episode}/finish",
                               body, proxy.admin_token)
    assert status == 200, reply
    return reply


def _run_rows(out, run: int, dataset: str) -> list[dict]:
    manifest = json.loads((out / "_manifest.json").read_text())
    files = [f for f in manifest["runs"][run]["files"] if f.startswith(dataset + "/")]
    return [row for f in files for row in pq.read_table(out / f).to_pylist()]


def test_a_repeated_finish_changes_nothing_and_a_new_result_supersedes(proxy, tmp_path):
    client = openai.OpenAI(base_url=proxy.episode_url("e"), api_key="x", max_retries=0)
    with client:
        client.chat.completions.create(model="mock-model", max_tokens=8,
                                       messages=[{"role": "user", "content": "hi"}])
    result = {"reward": 1.0, "rewards": {"pass": 1.0}, "outcome": "solved"}
    first = _finish(proxy, "e", result)
    assert (first["changed"], first["finish_seq"]) == (True, 1)
    stored = proxy.episode("e")
    out = tmp_path / "out"
    assert export(proxy.settings.db, out, incremental=True).episodes == 1

    # The trainer retries its finish (a timeout, a restart): nothing changes.
    again = _finish(proxy, "e", {"outcome": "solved", "rewards": {"pass": 1.0}, "reward": 1.0})
    assert (again["changed"], again["finish_seq"]) == (False, 1)
    assert proxy.episode("e") == stored  # finished_at too: not exported again
    assert export(proxy.settings.db, out, incremental=True).episodes == 0

    # Graded again with another reward: exported again, superseding the first rows.
    changed = _finish(proxy, "e", {**result, "reward": 0.25})
    assert (changed["changed"], changed["finish_seq"]) == (True, 2)
    assert export(proxy.settings.db, out, incremental=True).episodes == 1
    assert export(proxy.settings.db, out, incremental=True).episodes == 0
    for dataset in ("trajectories", "calls"):
        rows = [r for run in range(4) for r in _run_rows(out, run, dataset)]
        assert sorted((r["finish_seq"], r["reward"]) for r in rows) == [(1, 1.0), (2, 0.25)]
    # The readers' one line: the rows of each episode's latest finish.
    latest = duckdb.sql(
        f"select episode_id, reward from '{out}/trajectories/*.parquet' "
        "qualify finish_seq = max(finish_seq) over (partition by episode_id)").fetchall()
    assert latest == [("e", 0.25)]
