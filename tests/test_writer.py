"""The writer: journal first, batches after, nothing lost or duplicated, drops counted."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest
from asyncpg.exceptions import IntegrityConstraintViolationError

from proxy.ids import uuid7
from storage import queries
from storage.engine import create_engine
from storage.journal import Journal
from storage.records import CallRecord, ChoiceRecord
from storage.rows import insert_calls
from storage.writer import Writer, WriterObserver


class Counting(WriterObserver):
    def __init__(self):
        self.outcomes: dict[str, int] = {}

    def records(self, outcome: str, count: int) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + count


def _record(episode: str, i: int) -> CallRecord:
    return CallRecord(call_id=uuid7(), episode_id=episode, seq=i, endpoint="chat.completions",
                      t_start=float(i), prompt_ids=[1, 2, 3],
                      choices=[ChoiceRecord(index=0, completion_ids=[4, 5],
                                            completion_logprobs=[-0.5, -0.25])])


def test_a_full_journal_drops_and_counts_instead_of_blocking(db_url, tmp_path):
    async def run():
        engine = create_engine(db_url)
        counting = Counting()
        size = len(Writer.encode(_record("full", 1))) + 8  # + frame header
        writer = Writer(engine, Journal(tmp_path / "j", max_bytes=size * 3), observer=counting)
        accepted = [writer.submit(_record("full", i)) for i in range(5)]
        await writer.flush()
        calls = await queries.calls_of(engine, "full")
        await writer.close()
        await engine.dispose()
        return accepted, counting.outcomes, writer.dropped, calls

    accepted, outcomes, dropped, calls = asyncio.run(run())
    assert accepted == [True, True, True, False, False]
    assert dropped == 2 and outcomes == {"dropped": 2, "written": 3}
    assert [c["seq"] for c in calls] == [0, 1, 2]
    assert calls[0]["choices"][0]["completion_logprobs"] == [-0.5, -0.25]


def test_a_journal_left_behind_is_replayed_once(db_url, tmp_path):
    async def crash_then_restart():
        engine = create_engine(db_url)
        first = Writer(engine, Journal(tmp_path / "j", max_bytes=1 << 20))
        records = [_record("replay", i) for i in range(4)]
        for record in records:
            first.submit(record)
        first.journal.seal()  # the process dies here: nothing was written
        counting = Counting()
        second = Writer(engine, Journal(tmp_path / "j", max_bytes=1 << 20), observer=counting)
        await second.flush()
        # A replay of rows already stored (e.g. a crash after commit) stores nothing twice.
        again = Writer(engine, Journal(tmp_path / "k", max_bytes=1 << 20))
        for record in records:
            again.submit(record)
        await again.flush()
        calls = await queries.calls_of(engine, "replay")
        await engine.dispose()
        return counting.outcomes, calls, second.journal.bytes

    outcomes, calls, left = asyncio.run(crash_then_restart())
    assert outcomes == {"replayed": 4}
    assert len(calls) == 4 and left == 0


def test_a_large_batch_is_stored_whole_once_or_not_at_all(db_url):
    # 1,500 calls: more rows than one SQLite statement takes (it is cut in chunks) and
    # more episodes than one page of anything.
    records = [_record(f"big-{i % 7}", i) for i in range(1500)]
    records[700].choices.append(ChoiceRecord(index=1, completion_ids=[9],
                                             completion_logprobs=[-1.0]))

    async def run():
        engine = create_engine(db_url)
        try:
            await insert_calls(engine, records)
            await insert_calls(engine, records[:900])  # a replay stores nothing twice
            poisoned = [_record("atomic", 0), _record("atomic", 1)]
            poisoned[1].seq = None  # NOT NULL: the database refuses the batch
            with pytest.raises((sqlite3.IntegrityError, IntegrityConstraintViolationError)):
                await insert_calls(engine, poisoned)
            stored = [await queries.calls_of(engine, f"big-{k}") for k in range(7)]
            return stored, await queries.calls_of(engine, "atomic")
        finally:
            await engine.dispose()

    stored, atomic = asyncio.run(run())
    calls = {c["call_id"]: c for episode in stored for c in episode}
    assert len(calls) == 1500 and set(calls) == {r.call_id for r in records}
    assert all(c["prompt_ids"] == [1, 2, 3] for c in calls.values())
    two = calls[records[700].call_id]["choices"]
    assert [ch["index"] for ch in two] == [0, 1] and two[1]["completion_ids"] == [9]
    assert atomic == []  # nothing of the refused batch, not even its episode's first call
