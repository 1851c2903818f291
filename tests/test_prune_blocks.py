"""Prune and shared blocks (storage.retention): a block goes only when no call references
it any more, and a writer that knew the swept blocks stores them again."""

from __future__ import annotations

from sqlalchemy import text

from tests.test_dedup import _run, _same, conversation
from tracetap.exporters import export
from tracetap.exporters.prune import prune_exported
from tracetap.storage import queries
from tracetap.storage.dedup import BlockCache
from tracetap.storage.rows import insert_calls


async def _finish(engine, episode: str) -> None:
    await queries.finish_episode(engine, episode, reward=1.0, rewards=None, outcome=None,
                                 info=None)


async def _blocks(engine) -> int:
    async with engine.connect() as conn:
        return (await conn.execute(text("SELECT count(*) FROM blocks"))).scalar()


def test_a_block_shared_with_a_kept_episode_survives_its_prune(db_url, tmp_path):
    a, b = conversation("grpo-a", 3, seed=5), conversation("grpo-b", 3, seed=6)
    cache = BlockCache()

    async def write(engine):
        for turn in range(3):
            await insert_calls(engine, [a[turn], b[turn]], cache)
        await _finish(engine, "grpo-a")  # b is still running: export and prune leave it
        return await _blocks(engine)

    everything = _run(db_url, write)
    export(db_url, tmp_path / "out")
    first = prune_exported(db_url, tmp_path / "out")
    assert (first.counts.episodes, first.counts.calls) == (1, 3)
    assert 0 < first.counts.blocks < everything  # a's own blocks, not the shared ones

    async def late(engine):
        # The writer still remembers a's last call; its blocks are gone: a late call of a
        # must store them again, and b goes on reading whole.
        await insert_calls(engine, conversation("grpo-a", 4, seed=5)[3:], cache)
        return (await queries.calls_of(engine, "grpo-a"),
                await queries.calls_of(engine, "grpo-b"), await _blocks(engine))

    late_a, kept_b, left = _run(db_url, late)
    assert left > everything - first.counts.blocks  # stored again, not referenced as gone
    _same(late_a[0], conversation("grpo-a", 4, seed=5)[3])
    for got, record in zip(kept_b, b, strict=True):
        _same(got, record)


def test_pruning_every_call_leaves_no_block_behind(db_url, tmp_path):
    calls = [*conversation("all-a", 2, seed=7), *conversation("all-b", 2, seed=8)]

    async def write(engine):
        await insert_calls(engine, calls)
        await _finish(engine, "all-a")
        await _finish(engine, "all-b")

    _run(db_url, write)
    export(db_url, tmp_path / "out")
    dry = prune_exported(db_url, tmp_path / "out", dry_run=True)
    stored = _run(db_url, _blocks)
    assert dry.counts.blocks == stored > 0  # a dry run counts what would go, deletes nothing
    assert _run(db_url, _blocks) == stored
    real = prune_exported(db_url, tmp_path / "out")
    assert real.counts.blocks == stored and _run(db_url, _blocks) == 0
