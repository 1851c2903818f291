"""The writer: journal first, batches after, nothing lost or duplicated, drops counted."""

from __future__ import annotations

import asyncio
import logging
import re
import sqlite3
import time

import msgspec
import pytest
from asyncpg.exceptions import IntegrityConstraintViolationError
from helpers.loop import free_port
from helpers.servers import Forwarder
from sqlalchemy.exc import DBAPIError

from tracetap.migrations import upgrade
from tracetap.proxy.episodes.ids import uuid7
from tracetap.storage import queries
from tracetap.storage.engine import create_engine
from tracetap.storage.journal import Journal, read_segment
from tracetap.storage.records import CallRecord, ChoiceRecord
from tracetap.storage.rows import insert_calls
from tracetap.storage.writer import Writer, WriterObserver


class Counting(WriterObserver):
    def __init__(self):
        self.outcomes: dict[str, int] = {}
        self.writes: list[tuple[float, int]] = []

    def records(self, outcome: str, count: int) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + count

    def db_write(self, seconds: float, count: int) -> None:
        self.writes.append((seconds, count))


def _record(episode: str, i: int) -> CallRecord:
    return CallRecord(call_id=uuid7(), episode_id=episode, seq=i, endpoint="chat.completions",
                      t_start=float(i), prompt_ids=[1, 2, 3],
                      choices=[ChoiceRecord(index=0, completion_ids=[4, 5],
                                            completion_logprobs=[-0.5, -0.25])])


def test_a_full_journal_drops_and_counts_instead_of_blocking(db_url, tmp_path, caplog):
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

    with caplog.at_level(logging.ERROR, logger="tracetap.writer"):
        accepted, outcomes, dropped, calls = asyncio.run(run())
    assert accepted == [True, True, True, False, False]
    # Nothing is lost silently: the log names what was dropped, and the cure.
    messages = [r.getMessage() for r in caplog.records if "DROPPED" in r.getMessage()]
    assert len(messages) == 2
    for message in messages:
        assert re.fullmatch(r"JOURNAL FULL \(\d+ bytes\): call [0-9a-f-]{36} of episode full "
                            r"DROPPED; raise --journal-max-bytes or bring the database back",
                            message), message
    assert dropped == 2 and outcomes == {"dropped": 2, "written": 3}
    # The dropped calls leave tombstones (storage.tombstones): the episode shows them.
    assert [(c["seq"], c["status"]) for c in calls] == [
        (0, "ok"), (1, "ok"), (2, "ok"), (3, "record_dropped"), (4, "record_dropped")]
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


def test_a_segment_cut_mid_record_still_replays_every_earlier_record(db_url, tmp_path):
    async def run():
        engine = create_engine(db_url)
        crashed = Writer(engine, Journal(tmp_path / "j", max_bytes=1 << 20))
        for i in range(5):
            crashed.submit(_record("torn", i))
        segment = tmp_path / "j" / "000000000001.seg"  # active when the process dies
        segment.write_bytes(segment.read_bytes()[:-5])  # SIGKILL inside the fifth write
        counting = Counting()
        restarted = Writer(engine, Journal(tmp_path / "j", max_bytes=1 << 20),
                           observer=counting)
        await restarted.flush()
        calls = await queries.calls_of(engine, "torn")
        await engine.dispose()
        return counting.outcomes, calls, restarted.journal.bytes

    outcomes, calls, left = asyncio.run(run())
    assert [c["seq"] for c in calls] == [0, 1, 2, 3]
    assert outcomes == {"replayed": 4} and left == 0
    assert list((tmp_path / "j").glob("*.seg")) == []


def test_a_restart_after_a_kill_says_what_it_replayed_and_warns_of_nothing(db_url, tmp_path,
                                                                          caplog):
    async def run():
        engine = create_engine(db_url)
        killed = Writer(engine, Journal(tmp_path / "j", max_bytes=1 << 20))
        for i in range(3):
            killed.submit(_record("killed", i))
        segment = tmp_path / "j" / "000000000001.seg"  # active when the process dies
        segment.write_bytes(segment.read_bytes()[:-5])  # SIGKILL inside the third write
        restarted = Writer(engine, Journal(tmp_path / "j", max_bytes=1 << 20))
        restarted.start()
        await restarted.flush()
        await restarted.close()
        await engine.dispose()

    with caplog.at_level(logging.INFO, logger="tracetap"):
        asyncio.run(run())
    said = [(r.levelno, r.getMessage()) for r in caplog.records
            if r.name in ("tracetap.writer", "tracetap.journal")]
    assert all(level == logging.INFO for level, _ in said), said
    messages = [m for _, m in said]
    assert messages[0].startswith("journal: 1 segments (")
    assert "journal: replayed 2 records left by the previous process" in messages


@pytest.fixture
def forwarder(loop_thread) -> Forwarder:
    """Postgres behind a TCP forwarder the test can cut (an outage) and restore."""
    forwarder = Forwarder(loop_thread, free_port())
    forwarder.start()
    yield forwarder
    forwarder.cut()


DOWN = (OSError, DBAPIError)  # what a cut connection raises, depending on where it is cut


def test_an_outage_counts_each_record_spilled_once_then_replayed(fresh_postgres, forwarder,
                                                                  tmp_path):
    upgrade(fresh_postgres)

    async def run():
        engine = create_engine(forwarder.route(fresh_postgres))
        counting = Counting()
        writer = Writer(engine, Journal(tmp_path / "j", max_bytes=1 << 20), observer=counting)
        try:
            for i in range(2):
                writer.submit(_record("outage", i))
            await writer.flush()
            forwarder.cut()
            for i in range(2, 5):
                writer.submit(_record("outage", i))
            with pytest.raises(DOWN):
                await writer.flush()
            spilled_once = dict(counting.outcomes)
            writer.submit(_record("outage", 5))
            with pytest.raises(DOWN):
                await writer.flush()  # the failed segment again, and the new one waits behind
            spilled_twice = dict(counting.outcomes)
            pending = writer.pending
            forwarder.start()
            await writer.flush()
            calls = await queries.calls_of(engine, "outage")
            return spilled_once, spilled_twice, counting.outcomes, pending, writer, calls
        finally:
            await engine.dispose()

    spilled_once, spilled_twice, outcomes, pending, writer, calls = asyncio.run(run())
    assert spilled_once == spilled_twice == {"written": 2, "spilled": 3}  # counted once
    assert pending == 4
    # Every record once: written directly, or spilled and then replayed.
    assert outcomes == {"written": 3, "spilled": 3, "replayed": 3}
    assert [c["seq"] for c in calls] == list(range(6))
    assert writer.pending == 0 and writer.journal.bytes == 0
    assert writer._failed == set()  # nothing remembered of the outage once it is replayed


def _wait_for(condition, what: str, timeout: float = 30.0):
    async def wait():
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.02)  # polling a condition; assertions are on the data
    return wait()


def test_the_background_writer_retries_through_outages_and_says_so_once(
        fresh_postgres, forwarder, tmp_path, caplog):
    upgrade(fresh_postgres)

    async def outage(writer: Writer, first_seq: int) -> None:
        forwarder.cut()
        for seq in range(first_seq, first_seq + 3):
            writer.submit(_record("loop", seq))
            # Each attempt seals what came since the last one: a new segment on disk means
            # the writer tried again (it backs off, but never gives up).
            segments = seq - first_seq + 1
            await _wait_for(lambda n=segments: len(writer.journal.pending()) == n,
                            f"attempt {segments} during the outage")
        assert writer.db_healthy is False and writer.pending == 3
        forwarder.start()
        await _wait_for(lambda: writer.db_healthy and writer.pending == 0,
                        "the journal to be replayed")

    async def run():
        engine = create_engine(forwarder.route(fresh_postgres))
        counting = Counting()
        writer = Writer(engine, Journal(tmp_path / "j", max_bytes=1 << 20), observer=counting,
                        flush_interval=0.01)
        writer.start()
        try:
            await outage(writer, 0)
            await outage(writer, 3)  # the backoff starts over after a recovery
            writer.submit(_record("loop", 6))
            await writer.close()
            await writer.close()  # closing twice is harmless
            return counting.outcomes, await queries.calls_of(engine, "loop"), writer
        finally:
            await engine.dispose()

    with caplog.at_level(logging.WARNING, logger="tracetap.writer"):
        outcomes, calls, writer = asyncio.run(run())
    # Per outage, the first batch failed (spilled, then replayed); the two behind it
    # waited their turn and were written once the database was back.
    assert outcomes == {"spilled": 2, "replayed": 2, "written": 5}
    assert [c["seq"] for c in calls] == list(range(7))  # close() wrote the last one
    assert writer.journal.bytes == 0
    messages = [r.getMessage() for r in caplog.records]
    failed = [m for m in messages if m.startswith("database write failed")]
    assert len(failed) == 2  # once per outage, not once per attempt
    for message in failed:  # the log says what went wrong
        detail = message.removeprefix("database write failed, journaling until it is back: ")
        assert detail != message and detail not in ("", "None", "%s")
    assert messages.count("database is back; journal replayed") == 2


def test_records_a_closing_writer_cannot_write_wait_in_the_journal(fresh_postgres, forwarder,
                                                                   tmp_path, caplog):
    upgrade(fresh_postgres)

    async def run():
        engine = create_engine(forwarder.route(fresh_postgres))
        writer = Writer(engine, Journal(tmp_path / "j", max_bytes=1 << 20))
        writer.start()
        forwarder.cut()
        for i in range(3):
            writer.submit(_record("closing", i))
        await writer.close(timeout=2)  # the database is down: nothing raises, nothing lost
        left = writer.journal.bytes
        assert writer.pending == 3
        forwarder.start()
        counting = Counting()
        restarted = Writer(engine, Journal(tmp_path / "j", max_bytes=1 << 20),
                           observer=counting)
        await restarted.flush()
        calls = await queries.calls_of(engine, "closing")
        await engine.dispose()
        return left, counting.outcomes, calls

    with caplog.at_level(logging.WARNING, logger="tracetap.writer"):
        left, outcomes, calls = asyncio.run(run())
    assert left > 0
    [closed] = [r.getMessage() for r in caplog.records if "writer closed" in r.getMessage()]
    assert closed.startswith("writer closed with 3 records still journaled: ")
    assert not closed.endswith(": None")
    assert outcomes == {"replayed": 3} and [c["seq"] for c in calls] == [0, 1, 2]


def test_a_full_batch_wakes_the_writer_before_its_interval(db_url, tmp_path):
    async def run():
        engine = create_engine(db_url)
        writer = Writer(engine, Journal(tmp_path / "j", max_bytes=1 << 20),
                        flush_interval=3600, batch_records=3)
        writer.start()
        # Named, so that a task dump of a stuck shutdown shows what is waiting.
        assert "tracetap-writer" in {task.get_name() for task in asyncio.all_tasks()}
        try:
            for i in range(3):
                writer.submit(_record("batch", i))
            await _wait_for(lambda: writer.pending == 0, "the batch to be written")
            # close() stops the loop and returns: it does not sit out its timeout.
            await asyncio.wait_for(writer.close(timeout=3600), 60)
            return await queries.calls_of(engine, "batch")
        finally:
            await writer.close()
            await engine.dispose()

    assert [c["seq"] for c in asyncio.run(run())] == [0, 1, 2]


class BlackHole:
    """A database address that accepts connections and never answers (a hung server)."""

    def __init__(self, loop_thread):
        self.loop_thread = loop_thread
        self.port = free_port()
        self.transports = []

        async def start():
            self.server = await asyncio.start_server(self._swallow, "127.0.0.1", self.port)
        loop_thread.run(start())

    async def _swallow(self, reader, writer):
        self.transports.append(writer.transport)
        while await reader.read(65536):
            pass

    def close(self):
        async def close():
            self.server.close()
            for transport in self.transports:
                transport.abort()
        self.loop_thread.run(close())


def test_closing_never_hangs_on_a_database_that_does_not_answer(db_url, loop_thread,
                                                                 tmp_path):
    hole = BlackHole(loop_thread)

    async def run():
        engine = create_engine(f"postgresql://postgres@127.0.0.1:{hole.port}/x")
        writer = Writer(engine, Journal(tmp_path / "j", max_bytes=1 << 20),
                        flush_interval=0.01)
        writer.start()
        for i in range(3):
            writer.submit(_record("hung", i))
        # The background loop is inside its write, which will never return.
        await _wait_for(writer._flushing.locked, "the writer to start writing")
        # A shutdown is bounded by close()'s timeout (--drain-timeout), not by the database.
        await asyncio.wait_for(writer.close(timeout=1), 30)
        await engine.dispose()
        return writer.pending

    try:
        assert asyncio.run(run()) == 3
    finally:
        hole.close()

    async def replay():  # nothing lost: the next process writes it
        engine = create_engine(db_url)
        await Writer(engine, Journal(tmp_path / "j", max_bytes=1 << 20)).flush()
        calls = await queries.calls_of(engine, "hung")
        await engine.dispose()
        return calls

    assert [c["seq"] for c in asyncio.run(replay())] == [0, 1, 2]


def test_sealed_records_are_written_from_memory_up_to_cache_records(db_url, tmp_path):
    """The happy path never re-reads the disk, and memory stays bounded: the newest sealed
    segments, up to ``cache_records`` records, are written from memory; older ones are
    read back from disk. To tell which is which, each segment on disk is rewritten with
    the same records marked model="disk"."""
    small = len(Writer.encode(_record("cache", 0))) + 8
    big = _record("cache", 0)
    big.prompt_ids = list(range(1000, 1000 + 4 * small))
    assert len(Writer.encode(big)) + 8 >= 4 * small > 3 * small

    async def run():
        engine = create_engine(db_url)
        writer = Writer(engine, Journal(tmp_path / "j", max_bytes=1 << 20,
                                        segment_bytes=4 * small), cache_records=4)
        for seq in range(6):  # segments: [0] [1] [2 3 4 5]: 1 + 1 + 4 records
            record = _record("cache", seq)
            if seq < 2:
                record.prompt_ids = big.prompt_ids
            writer.submit(record)
        segments = writer.journal.pending()
        assert [len(list(read_segment(s))) for s in segments] == [1, 1, 4]
        for segment in segments:
            _mark_on_disk(segment, tmp_path / "scratch")
        await writer.flush()
        calls = await queries.calls_of(engine, "cache")
        await engine.dispose()
        return {c["seq"]: c["model"] for c in calls}, writer._cache

    models, held = asyncio.run(run())
    assert models == {0: "disk", 1: "disk", 2: None, 3: None, 4: None, 5: None}
    assert held == {}  # once written, nothing of it stays in memory


def _mark_on_disk(segment, scratch) -> None:
    """Rewrite a sealed segment with the same records, each with model="disk"."""
    marked = Journal(scratch / segment.stem, max_bytes=1 << 20)
    for payload in read_segment(segment):
        record = msgspec.msgpack.decode(payload, type=CallRecord)
        record.model = "disk"
        marked.append(Writer.encode(record))
    segment.write_bytes(marked.seal().read_bytes())


def test_each_committed_batch_reports_its_size_and_duration(db_url, tmp_path):
    async def run():
        engine = create_engine(db_url)
        counting = Counting()
        writer = Writer(engine, Journal(tmp_path / "j", max_bytes=1 << 20), observer=counting)
        for i in range(3):
            writer.submit(_record("timed", i))
        started = time.perf_counter()
        await writer.flush()
        elapsed = time.perf_counter() - started
        writer.submit(_record("timed", 3))
        await writer.flush()
        await engine.dispose()
        return counting.writes, elapsed

    writes, elapsed = asyncio.run(run())
    assert [count for _, count in writes] == [3, 1]
    assert 0 < writes[0][0] <= elapsed  # the commit's own time, inside the flush's
