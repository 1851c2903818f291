"""Annotations follow their episodes: ``tracetap prune`` deletes those of the episodes it
prunes (in the transaction that deletes the episode, so an episode kept because a call
arrived meanwhile keeps them), and an export's ``annotations/`` file holds only those of
the episodes that export selects, across its incremental runs."""

from __future__ import annotations

import asyncio

import pyarrow.parquet as pq
import pytest
from sqlalchemy import select

from tests.test_export_runs import _db, calls, finish, finished_at
from tracetap.exporters import export
from tracetap.exporters.prune import prune_exported
from tracetap.storage import annotations, retention
from tracetap.storage.annotations import NewAnnotation
from tracetap.storage.engine import create_engine
from tracetap.storage.tables import Annotation, Call


def note(episode: str, label: str):
    async def step(engine):
        await annotations.add(engine, NewAnnotation(episode=episode, label=label),
                              author="admin token", source="api")
    return step


def labelled(url: str) -> set[tuple[str, str]]:
    found = []

    async def step(engine):
        async with engine.connect() as conn:
            found.extend((await conn.execute(select(Annotation.episode_id,
                                                    Annotation.label))).all())
    _db(url, step)
    return {tuple(r) for r in found}


def test_prune_deletes_the_annotations_of_the_episodes_it_prunes(db_url, tmp_path):
    out = tmp_path / "out"
    _db(db_url, calls("a"), calls("b"), finish("a", 1.0), finish("b", 0.0),
        note("a", "good"), note("b", "bad"), note("b", "loops"))
    export(db_url, out, incremental=True)
    _db(db_url, calls("a", turns=1))  # a gets a late call: kept, with its annotation
    dry = prune_exported(db_url, out, dry_run=True)
    assert labelled(db_url) == {("a", "good"), ("b", "bad"), ("b", "loops")}
    real = prune_exported(db_url, out)
    assert dry.counts.annotations == real.counts.annotations == 2
    assert labelled(db_url) == {("a", "good")}


def test_an_episode_given_a_call_while_pruned_keeps_its_annotations(db_url, monkeypatch):
    from tracetap.proxy.episodes.ids import uuid7
    from tracetap.storage.records import CallRecord
    from tracetap.storage.rows import insert_calls

    _db(db_url, calls("x"), finish("x", 1.0), note("x", "good"))
    at = finished_at(db_url, "x")
    has = set()

    async def ids(engine):
        async with engine.connect() as conn:
            has.update((await conn.execute(select(Call.call_id))).scalars())
    _db(db_url, ids)
    late = CallRecord(call_id=uuid7(), episode_id="x", seq=9, endpoint="chat.completions",
                      t_start=1.0, request="{}")
    real_forget = retention.forget

    async def call_arrives_then_forget(conn, call_ids, *args):
        other = create_engine(db_url)
        try:
            await insert_calls(other, [late])
        finally:
            await other.dispose()
        await real_forget(conn, call_ids, *args)

    monkeypatch.setattr(retention, "forget", call_arrives_then_forget)

    async def run():
        engine = create_engine(db_url)
        try:
            await retention.prune(engine, {"x": {at: has}}, [], retention.PruneCounts(),
                                  dry_run=False)
        finally:
            await engine.dispose()

    asyncio.run(run())
    assert labelled(db_url) == {("x", "good")}


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the selection's SQL is shared
def test_the_export_holds_only_the_annotations_of_the_episodes_it_selects(db_url, tmp_path):
    _db(db_url, calls("a"), calls("b"), calls("c"), finish("a", 1.0), finish("b", 0.0),
        note("a", "good"), note("b", "bad"), note("c", "running"))
    one = tmp_path / "one"
    export(db_url, one, episodes=["a"])
    table = pq.read_table(one / "annotations" / "annotations.parquet").to_pylist()
    assert [(r["episode_id"], r["label"]) for r in table] == [("a", "good")]
    # Incremental: each run rewrites the file with every selected episode's annotations,
    # the earlier runs' too; an unfinished episode is not selected.
    runs = tmp_path / "runs"
    export(db_url, runs, incremental=True)
    _db(db_url, finish("c", 1.0), note("a", "again"))
    export(db_url, runs, incremental=True)
    table = pq.read_table(runs / "annotations" / "annotations.parquet").to_pylist()
    assert sorted((r["episode_id"], r["label"]) for r in table) == [
        ("a", "again"), ("a", "good"), ("b", "bad"), ("c", "running")]
    export(db_url, tmp_path / "none", episodes=["b"], finished_only=True, group="nope")
    assert not (tmp_path / "none" / "annotations" / "annotations.parquet").exists()
