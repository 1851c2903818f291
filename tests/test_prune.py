"""``tracetap prune --exported``: only rows an export's manifest and ledgers prove written
go; a pruned then re-exported range loses and duplicates nothing (docs/export.md)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers.objectstore import moto_server
from sqlalchemy import text

from tests.test_export_runs import _db, calls, finish, finished_at
from tracetap.exporters import ExportError, export
from tracetap.exporters.prune import prune_exported
from tracetap.storage.engine import create_engine

ROOT = Path(__file__).resolve().parents[1]


def rows(url: str) -> dict[str, set]:
    """Every row of the three tables, by key."""
    async def read():
        engine = create_engine(url)
        try:
            async with engine.connect() as conn:
                q = {"episodes": "SELECT id FROM episodes",
                     "calls": "SELECT call_id, episode_id FROM calls",
                     "choices": "SELECT call_id, choice_index FROM choices"}
                return {k: {tuple(r) for r in await conn.execute(text(s))} for k, s in q.items()}
        finally:
            await engine.dispose()

    return asyncio.run(read())


def exported_calls(out: Path) -> list[tuple[str, str]]:
    """(call_id, episode_id) of every calls/ row the manifest lists, one per call and run."""
    manifest = json.loads((out / "_manifest.json").read_text())
    found = []
    for run in manifest["runs"]:
        for name in run["files"]:
            if name.startswith("calls/"):
                table = pq.read_table(out / name, columns=["call_id", "episode_id"])
                found += sorted(set(zip(*table.to_pydict().values())))
    return found


def test_prune_deletes_only_what_the_export_holds_and_a_rerun_duplicates_nothing(
        db_url, tmp_path):
    out = tmp_path / "out"
    _db(db_url, calls("a"), calls("b"), calls("e", last_n=2),
        finish("a", 1.0), finish("b", 0.0), finish("e", 0.5))
    assert export(db_url, out, incremental=True).episodes == 3
    everything = rows(db_url)["calls"]
    # After the export: a gets a late call, b is graded again, c finishes, d is running.
    _db(db_url, calls("a", turns=1), finish("b", 1.0, at=finished_at(db_url, "b") + 1),
        calls("c"), finish("c", 1.0), calls("d"))
    everything |= rows(db_url)["calls"]

    before = rows(db_url)
    dry = prune_exported(db_url, out, dry_run=True)
    assert rows(db_url) == before  # a dry run deletes nothing...
    real = prune_exported(db_url, out)
    assert dry.counts == real.counts  # ...and says exactly what the real one does
    c = real.counts
    assert (c.episodes, c.calls, c.choices) == (1, 2, 3)  # e: 2 calls, 1 + 2 choices
    assert (c.kept_late_calls, c.kept_refinished, c.kept_running) == (1, 1, 0)
    after = rows(db_url)
    assert {e for (e,) in after["episodes"]} == {"a", "b", "c", "d"}
    assert {e for _, e in after["calls"]} == {"a", "b", "c", "d"}
    assert before["calls"] - after["calls"] == {k for k in before["calls"] if k[1] == "e"}

    assert export(db_url, out, incremental=True).episodes == 2  # b again (new reward), c
    second = prune_exported(db_url, out)
    assert (second.counts.episodes, second.counts.kept_late_calls) == (2, 1)  # b, c; a stays
    assert export(db_url, out, incremental=True).episodes == 0  # nothing comes back twice
    assert prune_exported(db_url, out).counts.episodes == 0

    left = rows(db_url)["calls"]
    written = Counter(exported_calls(out))
    assert set(written) | left == everything  # nothing lost...
    assert everything - left <= set(written)  # ...nothing pruned that the export lacks...
    # ...and nothing written twice but b, exported again because it was finished again.
    assert {k: n for k, n in written.items() if n > 1} == {k: 2 for k in written
                                                           if k[1] == "b"}
    assert {e for _, e in left} == {"a", "d"}


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_running_episodes_stay_and_untagged_calls_go(db_url, tmp_path):
    out = tmp_path / "everything"
    _db(db_url, calls("done"), finish("done", 1.0), calls("running"), calls(None, turns=3))
    export(db_url, out, finished_only=False)
    summary = prune_exported(db_url, out)
    assert (summary.counts.episodes, summary.counts.calls) == (1, 2 + 3)
    assert summary.counts.kept_running == 1
    left = rows(db_url)
    assert {e for (e,) in left["episodes"]} == {"running"}
    assert {e for _, e in left["calls"]} == {"running"}


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_prune_from_an_export_on_s3(db_url, tmp_path, monkeypatch):
    _db(db_url, calls("a"), calls("b"), finish("a", 1.0), finish("b", 1.0))
    with moto_server() as s3:
        for name, value in s3.env().items():
            monkeypatch.setenv(name, value)
        uri = f"s3://{s3.bucket()}/data"
        export(db_url, uri, incremental=True)
        _db(db_url, calls("c"), finish("c", 1.0))  # not exported
        summary = prune_exported(db_url, uri)
    assert (summary.counts.episodes, summary.counts.calls, summary.exported) == (2, 4, uri)
    assert {e for (e,) in rows(db_url)["episodes"]} == {"c"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracetap", "prune", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_cli_dry_run_prints_the_same_summary_and_bad_exports_are_refused(
        db_url, tmp_path):
    out = tmp_path / "out"
    _db(db_url, calls("a"), finish("a", 1.0))
    export(db_url, out)
    dry = _cli("--exported", str(out), "--db", db_url, "--dry-run")
    real = _cli("--exported", str(out), "--db", db_url)
    assert dry.returncode == real.returncode == 0, dry.stderr + real.stderr
    assert dry.stdout.startswith("dry run: would prune 1 episodes: 2 calls, 2 choices")
    same = lambda line: line.split(" in ")[0].replace("dry run: would prune", "pruned")  # noqa: E731
    assert same(dry.stdout) == same(real.stdout)
    assert rows(db_url)["episodes"] == set()

    trajectories_only = tmp_path / "t"
    export(db_url, trajectories_only, datasets=["trajectories"])
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "_manifest.json").write_text("{not json")
    for target, says in ((tmp_path / "nothing", "no export manifest at .*nothing was pruned"),
                         (tmp_path / "broken", "is not a tracetap export manifest"),
                         (trajectories_only, "has no calls/ dataset")):
        with pytest.raises(ExportError, match=says):
            prune_exported(db_url, target)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_runs_exported_before_ledgers_existed_prove_nothing(db_url, tmp_path):
    out = tmp_path / "out"
    _db(db_url, calls("a"), finish("a", 1.0))
    export(db_url, out, incremental=True)
    assert export(db_url, out, incremental=True).calls == 0  # a run with no call: no ledger
    manifest = json.loads((out / "_manifest.json").read_text())
    for run in manifest["runs"]:
        run.pop("ledger")  # as an older tracetap wrote it
    (out / "_manifest.json").write_text(json.dumps(manifest))
    summary = prune_exported(db_url, out)
    assert (summary.counts.episodes, summary.runs_without_ledger) == (0, 1)
    assert {e for (e,) in rows(db_url)["episodes"]} == {"a"}


# ---- storage.retention.prune on its own, with the proof (the ledger) written by hand ----

def _by_episode(url: str) -> dict[str | None, set[str]]:
    found: dict[str | None, set[str]] = {}
    for call_id, episode_id in rows(url)["calls"]:
        found.setdefault(episode_id, set()).add(call_id)
    return found


def test_prune_counts_add_up_over_chunks_and_only_exported_untagged_calls_go(db_url):
    """The CLI prunes a few hundred episodes a transaction into one PruneCounts: every
    count adds up over the chunks. An untagged call goes only if the export wrote it, and
    an id that names a call of an episode is not an untagged call."""
    from tracetap.storage.retention import PruneCounts, prune

    names = [f"{kind}{i}" for i in (1, 2) for kind in ("done", "run", "again", "late")]
    steps = [calls(name) for name in names] + [calls(None, turns=3)]
    steps += [finish(name, 1.0) for name in names if not name.startswith("run")]
    _db(db_url, *steps)
    has = _by_episode(db_url)
    untagged = sorted(has[None])

    def proof(name: str) -> dict:
        if name.startswith("run"):
            return {None: set(has[name])}
        at = finished_at(db_url, name)
        if name.startswith("again"):
            return {at - 1: set(has[name])}  # exported before it finished again
        if name.startswith("late"):
            return {at: set(sorted(has[name])[:-1])}  # a call stored after the export
        return {at: set(has[name])}

    chunks = [([n for n in names if n.endswith(i)], extra) for i, extra in (
        ("1", [untagged[0], next(iter(has["run1"]))]), ("2", [untagged[1]]))]
    proven = [({n: proof(n) for n in episodes}, extra) for episodes, extra in chunks]
    counts = PruneCounts()

    async def run():
        engine = create_engine(db_url)
        try:
            for chunk, extra in proven:
                await prune(engine, chunk, extra, counts, dry_run=False)
        finally:
            await engine.dispose()

    asyncio.run(run())
    assert counts == PruneCounts(episodes=2, calls=2 * 2 + 2, choices=2 * 2 + 2,
                                 kept_running=2, kept_refinished=2, kept_late_calls=2)
    left = _by_episode(db_url)
    assert left[None] == {untagged[2]}  # never exported: kept
    assert left["run1"] == has["run1"]  # its call's id was given as untagged: kept
    assert set(left) == {None, *(n for n in names if not n.startswith("done"))}


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_an_episode_finished_again_while_a_prune_reads_it_is_kept(db_url):
    """On Postgres the prune locks the episodes it reads: a finish in flight is waited
    for, and the episode, finished again since its export, stays (unlocked, the prune
    would read the old finish and delete the new result once the finish committed)."""
    from tracetap.storage.retention import PruneCounts, prune

    _db(db_url, calls("x"), finish("x", 1.0))
    has, at = _by_episode(db_url)["x"], finished_at(db_url, "x")
    counts = PruneCounts()

    async def run():
        engine = create_engine(db_url)
        try:
            async with engine.connect() as finishing:
                await finishing.execute(text("UPDATE episodes SET finished_at = :at "
                                             "WHERE id = 'x'"), {"at": at + 10})
                pruning = asyncio.create_task(prune(engine, {"x": {at: set(has)}}, [],
                                                    counts, dry_run=False))
                await asyncio.sleep(0.5)  # the prune has read, or waits to
                await finishing.commit()
            await pruning
        finally:
            await engine.dispose()

    asyncio.run(run())
    assert (counts.episodes, counts.kept_refinished) == (0, 1)
    assert _by_episode(db_url)["x"] == has


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_an_episode_outside_the_proof_or_given_a_call_meanwhile_is_kept(db_url, monkeypatch):
    """Only the proven episodes go, and not one that got a call between the prune's reads
    and its deletes (SQLite has no row lock: the delete itself checks)."""
    from tracetap.proxy.episodes.ids import uuid7
    from tracetap.storage import queries, retention
    from tracetap.storage.records import CallRecord
    from tracetap.storage.rows import insert_calls

    async def registered(engine):  # registered, no call yet: nothing proves it exported
        await queries.create_episode(engine, episode_id="fresh", key_hash="k" * 64,
                                     group_id=None, task_id=None, harness_name=None,
                                     harness_config=None, metadata=None)

    _db(db_url, registered, calls("x"), finish("x", 1.0))
    has, at = _by_episode(db_url)["x"], finished_at(db_url, "x")
    late = CallRecord(call_id=uuid7(), episode_id="x", seq=9, endpoint="chat.completions",
                      t_start=1.0, request="{}")
    real_forget = retention.forget

    async def call_arrives_then_forget(conn, call_ids, readers):
        other = create_engine(db_url)
        try:
            await insert_calls(other, [late])
        finally:
            await other.dispose()
        await real_forget(conn, call_ids, readers)

    monkeypatch.setattr(retention, "forget", call_arrives_then_forget)
    counts = retention.PruneCounts()

    async def run():
        engine = create_engine(db_url)
        try:
            await retention.prune(engine, {"x": {at: set(has)}}, [], counts, dry_run=False)
        finally:
            await engine.dispose()

    asyncio.run(run())
    left = rows(db_url)
    assert {e for (e,) in left["episodes"]} == {"fresh", "x"}
    assert {c for c, _ in left["calls"]} == {late.call_id}  # x's exported calls went


def test_a_sweep_that_fails_raises_its_own_error_and_leaves_no_transaction_open(db_url,
                                                                                 monkeypatch):
    """The lock and transaction are given up on either database, and what the caller
    sees is the failure itself (the CLI names it), not one of the clean-up."""
    from tracetap.storage import retention

    async def failing(raw, dialect):
        raise ConnectionResetError("the database went away")

    async def run():
        engine = create_engine(db_url)
        try:
            with pytest.raises(ConnectionResetError):
                await retention.sweep(engine, retention.Unlinked(blocks={b"h" * 32}),
                                      retention.PruneCounts(), dry_run=False)
            async with engine.begin() as conn:  # no lock or transaction left behind
                await conn.execute(text("DELETE FROM blocks"))
        finally:
            await engine.dispose()

    monkeypatch.setattr(retention, "begin_sweeping", failing)
    asyncio.run(run())
