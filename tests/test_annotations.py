"""Annotations: stored with who and when on SQLite and Postgres, checked and bounded, made
through the admin API (never with an agent's episode key), exported as the annotations/
snapshot beside the original reward, and a ``label=`` selector for compare and packets."""

from __future__ import annotations

import asyncio
import json

import pyarrow.parquet as pq
import pytest
from helpers.seeding import seed
from sqlalchemy import select

from tracetap import cli
from tracetap.analysis.compare import compare
from tracetap.analysis.episodes import AnalysisError, load
from tracetap.analysis.select import Success, parse_selector
from tracetap.exporters import export
from tracetap.storage import annotations
from tracetap.storage.annotations import NewAnnotation, Refused
from tracetap.storage.engine import create_engine
from tracetap.storage.records import CallRecord, ChoiceRecord
from tracetap.storage.rows import insert_calls
from tracetap.storage.scan import EpisodeFilter
from tracetap.storage.tables import Episode


def _run(url: str, work):
    async def go():
        engine = create_engine(url)
        try:
            return await work(engine)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def _tokened_call(engine):
    """A call of A-t1-0 whose choice holds 5 completion token ids."""
    return insert_calls(engine, [CallRecord(
        call_id="A-t1-0-c9", episode_id="A-t1-0", seq=9, instance="seed",
        endpoint="chat.completions", model="m", request="{}", response="{}", status="ok",
        http_status=200, t_start=1_700_000_090.0, t_end=1_700_000_091.0,
        choices=[ChoiceRecord(index=0, finish_reason="stop", text="abcde",
                              completion_ids=[1, 2, 3, 4, 5], token_source="engine")])])


def test_stored_with_author_and_time_on_both_databases_and_reward_kept(db_url):
    asyncio.run(seed(db_url))

    async def work(engine):
        await _tokened_call(engine)
        add = annotations.add
        first = await add(engine, NewAnnotation(episode="A-t1-0", label=" bad ",
                                                corrected_reward=0.25),
                          author="viewer session abc", source="viewer", now=10.0)
        await add(engine, NewAnnotation(call="A-t1-0-c9", choice=0, start=1, end=5,
                                        comment="loops here\nthen stops"),
                  author="admin token", source="api", now=11.0)
        await add(engine, NewAnnotation(call="A-t1-0-c1", label="good"),
                  author="admin token", source="api", now=12.0)
        found = await annotations.of_episodes(engine, ["A-t1-0"])
        async with engine.connect() as conn:
            reward = (await conn.execute(select(Episode.reward).where(
                Episode.id == "A-t1-0"))).scalar()
        return first, found, reward, await annotations.labels_of(engine, ["A-t1-0", "B-t1-0"])

    first, found, reward, labels = _run(db_url, work)
    assert first.label == "bad" and first.id > 0
    assert [(a.target, a.author, a.source, a.created_at) for a in found] == [
        ("episode", "viewer session abc", "viewer", 10.0),
        ("span", "admin token", "api", 11.0), ("call", "admin token", "api", 12.0)]
    assert (found[1].choice_index, found[1].token_start, found[1].token_end) == (0, 1, 5)
    assert found[1].comment == "loops here\nthen stops"
    assert found[0].corrected_reward == 0.25 and reward == 1.0  # the original is untouched
    assert labels == {"A-t1-0": {"bad", "good"}}


@pytest.mark.parametrize("new, why", [
    (NewAnnotation(episode="e"), "needs a label, a comment or a corrected_reward"),
    (NewAnnotation(episode="e", call="c", label="x"), "one of them"),
    (NewAnnotation(episode="e", label="x" * 65), "longer than 64"),
    (NewAnnotation(episode="e", comment="y" * 4001), "longer than 4000"),
    (NewAnnotation(episode="e", label="a\x00b"), "control characters"),
    (NewAnnotation(episode="e", comment="gnp.\u202eexe"), "control characters"),
    (NewAnnotation(episode="e", corrected_reward=float("nan")), "finite"),
    (NewAnnotation(call="c", choice=0, start=3, end=3, label="x"), "start < end"),
    (NewAnnotation(call="c", start=0, end=3, label="x"), "together"),
    (NewAnnotation(call="c", corrected_reward=1.0), "name the episode"),
    (NewAnnotation(call="c" * 129, label="x"), "at most 128"),
])
def test_refused_before_anything_is_written(new, why):
    with pytest.raises(Refused, match=why):
        annotations.check(new)


def test_targets_must_exist_spans_fit_and_the_count_is_capped(migrated_sqlite, tmp_path,
                                                                monkeypatch):
    url = migrated_sqlite(tmp_path / "t.db")
    asyncio.run(seed(url))
    monkeypatch.setattr(annotations, "MAX_PER_EPISODE", 3)

    async def work(engine):
        await _tokened_call(engine)
        errors = []
        for new in (NewAnnotation(episode="nope", label="x"),
                    NewAnnotation(call="nope", label="x"),
                    NewAnnotation(call="A-t1-0-c9", choice=0, start=0, end=6, label="x"),
                    NewAnnotation(call="A-t1-0-c9", choice=1, start=0, end=1, label="x")):
            with pytest.raises(Refused) as refused:
                await annotations.add(engine, new, author="t", source="api")
            errors.append((refused.value.status, str(refused.value)))
        for n in range(3):
            await annotations.add(engine, NewAnnotation(episode="A-t1-0", label=f"l{n}"),
                                  author="t", source="api")
        with pytest.raises(Refused) as full:
            await annotations.add(engine, NewAnnotation(episode="A-t1-0", label="more"),
                                  author="t", source="api")
        return errors, full.value, len(await annotations.of_episodes(engine, ["A-t1-0"]))

    errors, full, count = _run(url, work)
    assert [s for s, _ in errors] == [404, 404, 400, 404]
    assert "has 5 completion tokens" in errors[2][1]
    assert full.status == 409 and count == 3


def test_export_writes_the_snapshot_beside_the_original_reward(seeded, tmp_path):
    async def work(engine):
        await annotations.add(engine, NewAnnotation(episode="B-t2-0", corrected_reward=0.5,
                                                    label="grader-wrong"),
                              author="admin token", source="api", now=5.0)

    _run(seeded, work)
    summary = export(seeded, tmp_path / "out", datasets=["calls"])
    assert summary.annotations == 1
    rows = pq.read_table(tmp_path / "out" / "annotations").to_pylist()
    assert [(r["episode_id"], r["target"], r["label"], r["corrected_reward"],
             r["original_reward"], r["author"]) for r in rows] == [
        ("B-t2-0", "episode", "grader-wrong", 0.5, 0.0, "admin token")]
    calls = pq.read_table(tmp_path / "out" / "calls").to_pylist()
    assert {r["reward"] for r in calls if r["episode_id"] == "B-t2-0"} == {0.0}


def test_label_selector_picks_the_labelled_episodes_for_compare(seeded):
    async def work(engine):
        for eid, label in (("A-t1-0", "curated"), ("A-t2-0", "curated"),
                           ("B-t1-0", "curated"), ("B-t2-0", "curated")):
            await annotations.add(engine, NewAnnotation(episode=eid, label=label),
                                  author="t", source="api")

    _run(seeded, work)
    episodes = load(seeded, EpisodeFilter())
    chosen = parse_selector("label=curated")
    assert sorted(e.id for e in episodes if chosen.matches(e)) == [
        "A-t1-0", "A-t2-0", "B-t1-0", "B-t2-0"]
    assert sum(parse_selector("label=null").matches(e) for e in episodes) == 20
    result = compare(episodes, parse_selector("harness=A,label=curated"),
                     [parse_selector("harness=B,label=curated")], success=Success())
    # t1 and t2 only: the labelled ones
    assert (result.baseline.tasks, result.candidates[0].paired_tasks) == (2, 2)
    with pytest.raises(AnalysisError, match="unknown key"):
        parse_selector("labels=x")
    unread = load(seeded, EpisodeFilter(), labels=False)  # an error, never "no label"
    with pytest.raises(AnalysisError, match="read with their labels"):
        chosen.matches(unread[0])


def test_packets_where_label_keeps_the_labelled_failures(migrated_sqlite, tmp_path):
    url = migrated_sqlite(tmp_path / "p.db")
    asyncio.run(seed(url))

    async def work(engine):
        for eid in ("A-t4-1", "B-t2-0"):  # two failed episodes; A-t5-1 failed too, unlabelled
            await annotations.add(engine, NewAnnotation(call=f"{eid}-c1", choice=None,
                                                        label="bad"),
                                  author="t", source="api")

    _run(url, work)
    out = tmp_path / "packets"
    assert cli.main(["packets", "--db", url, "--out", str(out), "--where", "label=bad"]) == 0
    found = [json.loads(line)["episode_id"]
             for line in (out / "packets.jsonl").read_text().splitlines()]
    assert sorted(found) == ["A-t4-1", "B-t2-0"]


def test_tree_reads_the_family_and_the_calls_on_both_databases(db_url, monkeypatch):
    """storage.relatives on SQLite and Postgres: the parent, the children (capped, counted
    in full) and the calls, failed ones marked; viewer.tree builds on them."""
    from tracetap.storage import queries, relatives
    from tracetap.viewer.tree import build

    asyncio.run(seed(db_url))
    monkeypatch.setattr(relatives, "MAX_CHILDREN", 2)

    async def work(engine):
        for n in range(3):
            await queries.create_episode(
                engine, episode_id=f"kid-{n}", key_hash=f"{n:0>64}", group_id=None,
                task_id=None, harness_name=None, harness_config=None, metadata=None,
                parent_id="A-t1-0")
        await queries.create_episode(
            engine, episode_id="orphan", key_hash="f" * 64, group_id=None, task_id=None,
            harness_name=None, harness_config=None, metadata=None, parent_id="gone")
        return (await relatives.relatives(engine, "A-t1-0"),
                await relatives.relatives(engine, "kid-1"),
                await relatives.relatives(engine, "orphan"),
                await relatives.tree_calls(engine, "A-t4-0"))

    family, kid, orphan, calls = _run(db_url, work)
    assert [c.id for c in family.children] == ["kid-0", "kid-1"]
    assert family.children_total == 3 and family.parent is None
    assert kid.parent.id == "A-t1-0" and kid.parent.reward == 1.0 and not kid.children
    assert orphan.parent is None and orphan.parent_id == "gone"
    # A-t4-0: its second call failed upstream (502).
    assert [(c.seq, c.failed) for c in calls] == [(0, False), (1, True)]
    tree = build(calls, family)
    assert tree.lineages == 1 and tree.roots[0].kind == "main" and tree.roots[0].failed == 1


def test_the_snapshot_on_object_storage_and_a_stale_one_removed(migrated_sqlite, tmp_path):
    import fsspec

    url = migrated_sqlite(tmp_path / "s.db")
    asyncio.run(seed(url))
    uri, memory = "memory://tracetap-notes/data", fsspec.filesystem("memory")
    try:
        _run(url, lambda engine: annotations.add(
            engine, NewAnnotation(episode="A-t3-1", label="odd"), author="t", source="api"))
        assert export(url, uri, datasets=["calls"]).annotations == 1
        with memory.open("/tracetap-notes/data/annotations/annotations.parquet", "rb") as f:
            assert pq.read_table(f).column("label").to_pylist() == ["odd"]
        # Another database into the same export: its (no) annotations, not the old file.
        other = migrated_sqlite(tmp_path / "other.db")
        asyncio.run(seed(other))
        assert export(other, uri, datasets=["calls"], overwrite=True).annotations == 0
        assert not memory.exists("/tracetap-notes/data/annotations/annotations.parquet")
    finally:
        memory.rm("/tracetap-notes", recursive=True)


def test_a_chain_of_named_lineages_is_drawn_shallow_and_bounded():
    """An agent names each call a new lineage whose parent is the previous one: the tree
    stays MAX_DEPTH deep and MAX_DRAWN long, and says how many it left out."""
    from tracetap.storage.relatives import Relatives, TreeCall
    from tracetap.viewer import tree as viewer_tree
    from tracetap.viewer.render import Templates

    calls = [TreeCall(call_id=f"c{i:04d}", seq=i, t_start=float(i), t_end=i + 0.5,
                      conversation=None, lineage=f"l{i}",
                      parent_lineage=f"l{i - 1}" if i else None, failed=False)
             for i in range(1000)]
    built = viewer_tree.build(calls, Relatives(parent=None, parent_id=None, children=[],
                                                children_total=0))

    def depth(nodes, level=0):  # how far the deepest node is nested under its root
        return max((depth(n.children, level + 1) if n.children else level for n in nodes),
                   default=level)

    def count(nodes):
        return sum(1 + count(n.children) for n in nodes)

    assert built.lineages == 1000 and built.hidden == 1000 - viewer_tree.MAX_DRAWN
    assert count(built.roots) == viewer_tree.MAX_DRAWN
    assert depth(built.roots) == viewer_tree.MAX_DEPTH
    html = Templates().render("_lineage.html", tree=built)
    assert html.count("<details") == viewer_tree.MAX_DRAWN
    assert "and 800 more lineages, not drawn" in html
