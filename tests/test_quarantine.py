"""No record can block another: what the database refuses is split out, quarantined in
the dead-letter file with its reason, and counted; every other record is written, on
the first try and on the replay after a crash."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re

import pytest

from tracetap.proxy.ids import uuid7
from tracetap.storage import queries
from tracetap.storage.engine import create_engine
from tracetap.storage.journal import Journal
from tracetap.storage.quarantine import Quarantine, read_all
from tracetap.storage.records import CallRecord, ChoiceRecord
from tracetap.storage.refusal import is_refusal, write_batch
from tracetap.storage.storable import MARK, UNSTORABLE_IDS
from tracetap.storage.writer import Writer, WriterObserver


class Counting(WriterObserver):
    def __init__(self):
        self.outcomes: dict[str, int] = {}

    def records(self, outcome: str, count: int) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + count


def _normal(i: int) -> CallRecord:
    return CallRecord(call_id=uuid7(), episode_id=f"normal-{i % 5}", seq=i,
                      endpoint="chat.completions", t_start=float(i), prompt_ids=[1, 2, 3],
                      model="m", request='{"model": "m"}',
                      choices=[ChoiceRecord(index=0, text="hi", completion_ids=[4, 5],
                                            completion_logprobs=[-0.5, -0.25])])


def _poison(kind: str) -> CallRecord:
    """What an agent can make the proxy capture that a database will not take as it is."""
    record = _normal(0)
    record.call_id, record.episode_id = uuid7(), f"poison-{kind}"
    if kind == "id_over_int32":  # a legacy completions prompt of ids the engine rejected
        record.prompt_ids = [1, 2**40, 3]
    elif kind == "id_over_uint64":  # not even msgpack (the journal) holds it
        record.prompt_ids = [1, 2**70]
    elif kind == "completion_id_negative":
        record.choices[0].completion_ids = [-(2**33)]
    elif kind == "nul":  # "\u0000" in JSON strings, a raw NUL byte in the body
        record.model, record.request = "m\x00", '{"model": "m\x00"}'
        record.choices[0].text = "a\x00b"
    elif kind == "surrogate":  # never valid UTF-8: neither database nor journal takes it
        record.model = "m\ud800"
    elif kind == "long_model":
        record.model = "m" * 300
    elif kind == "long_episode":  # an id is never cut: a prefix would be another episode
        record.episode_id = "e" * 300
    elif kind == "nul_episode":  # nor changed: "a\ufffdb" could be someone else's episode
        record.episode_id = "a\x00b"
    elif kind == "counts_over_int32":  # Postgres' integer is int4
        record.completion_tokens = 2**40
    elif kind == "counts_over_int64":
        record.prompt_tokens = 2**63
    elif kind == "missing_seq":  # a required value missing: a constraint refuses it
        record.seq = None
    elif kind == "huge_top_logprobs":  # from the engine as it was: msgpack cannot hold it
        record.choices[0].top_logprobs = [[{"token": "a", "logprob": -1, "id": 2**70}]]
    elif kind == "nan_logprobs":  # stored as they are (float64 bytes)
        record.choices[0].completion_logprobs = [math.nan, -math.inf]
    else:
        raise AssertionError(kind)
    return record


POISON = ("id_over_int32", "id_over_uint64", "completion_id_negative", "nul", "surrogate",
          "long_model", "long_episode", "nul_episode", "counts_over_int32",
          "counts_over_int64", "missing_seq", "huge_top_logprobs", "nan_logprobs")

# Altered before they are journaled (msgpack cannot hold them): no original to keep.
JOURNAL_ALTERED = ("id_over_uint64", "surrogate", "huge_top_logprobs")


def _expected(kind: str, dialect: str) -> str:
    """stored, altered (stored with a note) or refused (only in the dead-letter file)."""
    postgres = dialect == "postgresql"
    if kind in ("id_over_int32", "id_over_uint64", "completion_id_negative", "surrogate",
                "counts_over_int64", "huge_top_logprobs"):
        return "altered"
    if kind in ("nul", "long_model", "counts_over_int32"):
        return "altered" if postgres else "stored"
    if kind in ("long_episode", "nul_episode"):
        return "refused" if postgres else "stored"
    if kind == "missing_seq":
        return "refused"
    return "stored"


@pytest.mark.parametrize("stage", ["first_try", "replay"])
def test_poison_records_never_hold_up_the_others(db_url, tmp_path, stage, caplog):
    """100 normal calls with every kind of poison between them, in batches: all 100 are
    stored; each poison record is stored (altered where it has to be, and marked) or
    quarantined with its reason; the counters say so. ``replay``: the first writer dies
    with everything still journaled, and the next process's replay does the same."""
    normal = [_normal(i) for i in range(100)]
    poison = {kind: _poison(kind) for kind in POISON}
    mixed = list(normal)
    for n, record in enumerate(poison.values()):
        mixed.insert(7 + 9 * n, record)

    async def run():
        engine = create_engine(db_url)
        first = Counting()
        writer = Writer(engine, Journal(tmp_path / "journal", max_bytes=64 << 20),
                        observer=first, batch_records=16)
        try:
            half = len(mixed) // 2
            for record in mixed[:half]:
                writer.submit(record)
            await writer.flush()  # the first half written in one process
            for record in mixed[half:]:
                writer.submit(record)
            if stage == "first_try":
                await writer.flush()
            else:
                writer.journal.seal()  # the process dies: the second half stays journaled
            replay = Counting()
            restarted = Writer(engine, Journal(tmp_path / "journal", max_bytes=64 << 20),
                               observer=replay)
            await restarted.flush()
            stored = {}
            for episode in {r.episode_id for r in mixed}:
                if "\x00" in episode and engine.dialect.name == "postgresql":
                    continue  # not even a query can name it there (it is not stored)
                for call in await queries.calls_of(engine, episode):
                    stored[call["call_id"]] = call
            return engine.dialect.name, first.outcomes, replay.outcomes, stored, restarted
        finally:
            await engine.dispose()

    with caplog.at_level(logging.WARNING, logger="tracetap.writer"):
        dialect, first, replay, stored, restarted = asyncio.run(run())
    assert all(r.call_id in stored for r in normal), "a normal call was not stored"
    assert all(stored[r.call_id]["prompt_ids"] == [1, 2, 3] for r in normal)
    entries = {e.call_id: e for e in read_all(tmp_path)}
    expected = {kind: _expected(kind, dialect) for kind in POISON}
    for kind, record in poison.items():
        # A record that no longer decodes on replay (missing_seq) is kept as its bytes.
        entry = entries.get(record.call_id) or next(
            (e for e in entries.values() if record.call_id.encode() in e.record), None)
        if expected[kind] == "stored":
            assert entry is None, kind
            assert stored[record.call_id]["error"] is None, kind
        elif expected[kind] == "altered":
            call = stored[record.call_id]
            assert MARK in call["error"], kind
            if kind not in JOURNAL_ALTERED:
                assert entry.kind == "altered" and entry.reason, kind
                assert entry.call() == record, kind  # kept as captured
        else:
            # Only its tombstone is stored (storage.tombstones), where the database takes
            # the episode id: the record itself is only in the dead-letter file.
            tomb = stored.get(record.call_id)
            assert tomb is None or (tomb["status"] == "record_quarantined"
                                    and tomb["request"] is None), kind
            assert entry.kind == "refused", kind
            assert entry.database == dialect and entry.reason, kind
    refused = [k for k, v in expected.items() if v == "refused"]
    altered = [k for k, v in expected.items() if v == "altered"]
    # The reason says what was refused: the constraint, or the record that no longer decodes.
    missing_seq = next(e for e in entries.values()
                       if poison["missing_seq"].call_id.encode() in e.record)
    assert re.search(r"seq|null|undecodable", missing_seq.reason, re.I), missing_seq.reason
    assert stored[poison["id_over_int32"].call_id]["prompt_ids"] is None
    assert stored[poison["id_over_int32"].call_id]["ids_missing"] == UNSTORABLE_IDS
    assert stored[poison["completion_id_negative"].call_id]["choices"][0][
        "completion_ids"] is None
    logprobs = stored[poison["nan_logprobs"].call_id]["choices"][0]["completion_logprobs"]
    assert math.isnan(logprobs[0]) and logprobs[1] == -math.inf
    if dialect == "postgresql":
        nul = stored[poison["nul"].call_id]
        assert nul["model"] == "m\ufffd" and nul["choices"][0]["text"] == "a\ufffdb"
        assert nul["request"] == '{"model": "m\\u0000"}'  # the JSON escape: same string
        assert stored[poison["long_model"].call_id]["model"] == "m" * 256
    # Counted once each, across both processes.
    total = {k: first.get(k, 0) + replay.get(k, 0) for k in set(first) | set(replay)}
    assert total.get("quarantined", 0) == len(refused)
    assert total.get("altered", 0) == len(altered)
    assert total.get("written", 0) + total.get("replayed", 0) == len(mixed) - len(refused)
    if stage == "replay":
        assert replay.get("replayed", 0) > 0
    assert restarted.journal.bytes == 0 and list((tmp_path / "journal").glob("*.seg")) == []
    # One log line a batch (a flood must not flood the log), naming how many.
    logged = [re.match(r"QUARANTINED (\d+) ", r.getMessage()) for r in caplog.records]
    assert sum(int(m.group(1)) for m in logged if m) == len(refused)


def test_a_replay_after_a_crash_does_not_quarantine_twice(db_url, tmp_path):
    """The dead-letter line is written before the segment is deleted; a crash in between
    replays the segment, and the record is kept once."""
    poison = _poison("missing_seq")

    async def run():
        engine = create_engine(db_url)
        try:
            quarantine = Quarantine(tmp_path / "dead.jsonl")
            counts = []
            for _ in range(2):  # the same segment twice, as a replay would
                outcome = await write_batch(engine, [_normal(1), poison])
                counts.append(quarantine.add([_entry(r, engine) for r in outcome.refused]))
            again = Quarantine(tmp_path / "dead.jsonl")  # a new process
            outcome = await write_batch(engine, [poison])
            counts.append(again.add([_entry(r, engine) for r in outcome.refused]))
            return counts
        finally:
            await engine.dispose()

    assert asyncio.run(run()) == [1, 0, 0]


def _entry(refused, engine):
    from tracetap.storage.quarantine import entry
    return entry(refused.record, "refused", refused.reason, engine.dialect.name)


def test_an_outage_is_not_a_refusal():
    """Only the data's fault is quarantined; a lost connection is retried for ever."""
    import sqlite3

    from asyncpg.exceptions import (
        CannotConnectNowError,
        ConnectionDoesNotExistError,
        DataError,
        NotNullViolationError,
        StringDataRightTruncationError,
        UndefinedTableError,
    )

    assert is_refusal(StringDataRightTruncationError("value too long"))
    assert is_refusal(NotNullViolationError("null value"))
    assert is_refusal(DataError("invalid input for query argument $1"))
    assert is_refusal(sqlite3.IntegrityError("NOT NULL constraint failed"))
    assert is_refusal(OverflowError("Python int too large to convert to SQLite INTEGER"))
    assert not is_refusal(ConnectionDoesNotExistError("connection was closed"))
    assert not is_refusal(CannotConnectNowError("the database system is starting up"))
    assert not is_refusal(UndefinedTableError('relation "calls" does not exist'))
    assert not is_refusal(sqlite3.OperationalError("database is locked"))
    assert not is_refusal(OSError("connection refused"))
    assert not is_refusal(TimeoutError())


def test_the_cli_lists_and_shows_what_is_kept_even_bytes_that_do_not_decode(tmp_path, capsys):
    from tracetap.cli import main
    from tracetap.storage.quarantine import count, entry, raw_entry

    assert main(["quarantine", "list", "--data-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("nothing quarantined in ")
    assert count(tmp_path) == (0, 0)
    refused = _poison("missing_seq")
    quarantine = Quarantine.beside(tmp_path / "journal")
    quarantine.add([entry(refused, "refused", "IntegrityError: NOT NULL constraint failed: "
                          "calls.seq", "sqlite"),
                    raw_entry(b"\xc1 not msgpack", "undecodable journal record: x", "sqlite")])
    assert count(tmp_path) == (2, 0)  # what the viewer's list page shows
    assert main(["quarantine", "list", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert refused.call_id in out and "NOT NULL constraint failed" in out
    assert "undecodable-" in out and out.rstrip().endswith(
        "2 records: 2 refused (not stored), 0 stored altered")
    assert main(["quarantine", "show", refused.call_id, "--data-dir", str(tmp_path)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["record"]["episode_id"] == "poison-missing_seq" and shown["kind"] == "refused"
    undecodable = next(e.call_id for e in read_all(tmp_path) if e.call_id != refused.call_id)
    assert main(["quarantine", "show", undecodable, "--data-dir", str(tmp_path)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["record"] is None and shown["record_bytes_base64"]
    assert main(["quarantine", "show", "no-such-call", "--data-dir", str(tmp_path)]) == 2
    assert "no quarantined record no-such-call" in capsys.readouterr().err


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_dead_letter_file_is_bounded_and_what_it_leaves_out_is_counted(db_url, tmp_path):
    """An agent that sends nothing but records the database refuses must not fill the disk:
    the dead-letter file stops at its bound, the refused records it cannot keep are counted
    as dropped, and the normal calls are all stored."""
    bound = 4096
    poison = [_poison("missing_seq") for _ in range(40)]
    normal = [_normal(i) for i in range(20)]

    async def run():
        engine = create_engine(db_url)
        counting = Counting()
        writer = Writer(engine, Journal(tmp_path / "journal", max_bytes=64 << 20),
                        observer=counting, batch_records=8,
                        quarantine=Quarantine(tmp_path / "quarantine" / "journal.jsonl", bound))
        try:
            for record in [*poison, *normal]:
                writer.submit(record)
            await writer.flush()
            stored = {c["call_id"] for e in {r.episode_id for r in normal}
                      for c in await queries.calls_of(engine, e)}
            return counting.outcomes, stored
        finally:
            await engine.dispose()

    outcomes, stored = asyncio.run(run())
    assert {r.call_id for r in normal} <= stored
    kept = read_all(tmp_path)
    assert 0 < len(kept) < len(poison)
    assert (tmp_path / "quarantine" / "journal.jsonl").stat().st_size <= bound
    assert outcomes["quarantined"] == len(kept)
    assert outcomes["dropped"] == len(poison) - len(kept)
