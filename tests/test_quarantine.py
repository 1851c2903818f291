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

from tracetap.proxy.episodes.ids import uuid7
from tracetap.storage import queries
from tracetap.storage.engine import create_engine
from tracetap.storage.journal import Journal
from tracetap.storage.quarantine import Quarantine, read_all
from tracetap.storage.records import CallRecord, ChoiceRecord
from tracetap.storage.refusal import Outcome, is_refusal, write_batch
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


# ---- each step on its own: what is a refusal, what storable changes and says, the file ----

def test_a_refusal_is_the_datas_fault_however_the_driver_wraps_it():
    import sqlite3
    import struct

    from asyncpg.exceptions import (
        CheckViolationError,
        ProgramLimitExceededError,
        SerializationError,
    )
    from sqlalchemy.exc import DBAPIError, OperationalError

    wrapped = DBAPIError("INSERT", {}, CheckViolationError("check"))
    assert is_refusal(wrapped)  # 23514, under SQLAlchemy's wrapper
    assert is_refusal(ProgramLimitExceededError("row too big"))  # 54000
    assert not is_refusal(SerializationError("retry"))  # 40001: retrying helps
    lost = DBAPIError("INSERT", {}, CheckViolationError("check"), connection_invalidated=True)
    assert not is_refusal(lost)  # the connection went with it: an outage
    assert not is_refusal(OperationalError("INSERT", {}, sqlite3.OperationalError("locked")))
    bare = DBAPIError("INSERT", {}, None)  # nothing underneath: judged as itself
    bare.orig = None
    assert not is_refusal(bare)
    for error in (ValueError(), TypeError(), struct.error(), sqlite3.DataError(),
                  sqlite3.ProgrammingError(), UnicodeEncodeError("utf-8", "\ud800", 0, 1, "x")):
        assert is_refusal(error), error


def test_the_reason_is_one_bounded_line_naming_the_error():
    from tracetap.storage.refusal import reason

    assert reason(ValueError("bad\n  value\tthere ")) == "ValueError: bad value there"
    assert len(reason(ValueError("x" * 5000))) == 1000


def test_a_refused_record_is_split_out_of_its_batch_and_the_rest_written_once():
    from tracetap.storage.refusal import Altered, Refused

    class Engine:  # the dialect is all write_batch reads of it
        class dialect:
            name = "postgresql"

    batches = []

    async def insert(engine, records):
        batches.append([r.call_id for r in records])
        if any(r.seq is None or (r.model or "").startswith("\x00") for r in records):
            raise ValueError("refused")

    good = [_normal(i) for i in range(5)]
    bad, fixable = _poison("missing_seq"), _poison("nul")
    fixable.model = "\x00m"
    outcome = asyncio.run(write_batch(Engine(), [*good[:2], bad, fixable, *good[2:]], insert))
    assert [r.record for r in outcome.refused] == [bad]
    assert outcome.refused == [Refused(bad, "ValueError: refused")]
    assert [a.record for a in outcome.altered] == [fixable]  # stored as storable made it
    assert outcome.altered == [Altered(fixable, ["model: NUL replaced with U+FFFD",
                                                 "request: NUL written as \\u0000",
                                                 "choices[0].text: NUL replaced with U+FFFD"])]
    assert batches[0] == [r.call_id for r in [*good[:2], bad, fixable, *good[2:]]]
    # Halves until the refused one is alone (tried once more only if storable changed it):
    # 7 -> 3 (1, 2 -> 1, 1) and 4 (2 -> 1 -> its altered copy, 1; 2).
    assert [len(b) for b in batches] == [7, 3, 1, 2, 1, 1, 4, 2, 1, 1, 1, 2]
    assert batches[-4] == [fixable.call_id]  # the altered copy, under the same id
    assert asyncio.run(write_batch(Engine(), [], insert)) == Outcome()
    assert len(batches) == 12  # nothing to write: nothing asked


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_storable_says_what_it_changed_and_changes_only_that(dialect):
    from tracetap.storage.storable import storable

    record = _normal(0)
    record.prompt_ids, record.prompt_tokens, record.completion_tokens = [1, 2**31], 2**31, 5
    record.model, record.error = "m" * 300, "upstream said no"
    record.request = '{"a": "\x00"}'
    record.choices = [ChoiceRecord(index=0, text="fine", completion_ids=[1]),
                      ChoiceRecord(index=1, text="t\x00", completion_ids=[-(2**31) - 1],
                                   finish_reason="f" * 40, top_logprobs=[{"id": 2**70}],
                                   completion_logprobs=[-1, "x"])]
    fixed, notes = storable(record, dialect)
    postgres = dialect == "postgresql"
    expected = (["prompt_tokens 2147483648 out of range, not stored"] if postgres else []) + [
        "prompt_ids: a token id outside int32, ids not stored"]
    if postgres:
        expected += ["model: 300 characters cut to 256", "request: NUL written as \\u0000",
                     "choices[1].finish_reason: 40 characters cut to 32",
                     "choices[1].text: NUL replaced with U+FFFD"]
    expected += ["choices[1].completion_ids: a token id outside int32, ids not stored",
                 "choices[1].top_logprobs: not encodable, not stored",
                 "choices[1].completion_logprobs: not numbers, not stored"]
    assert notes == expected
    assert fixed.error == "upstream said no; " + MARK + "; ".join(expected)
    assert fixed.prompt_ids is None and fixed.prompt_ids_packed is None
    assert (fixed.prompt_source, fixed.ids_missing) == ("none", UNSTORABLE_IDS)
    assert fixed.prompt_tokens == (None if postgres else 2**31) and fixed.completion_tokens == 5
    assert fixed.model == ("m" * 256 if postgres else "m" * 300)
    assert fixed.request == ('{"a": "\\u0000"}' if postgres else '{"a": "\x00"}')
    assert fixed.choices[0] is record.choices[0]  # nothing to change: the same choice
    changed = fixed.choices[1]
    assert changed.text == ("t\ufffd" if postgres else "t\x00")
    assert changed.finish_reason == ("f" * 32 if postgres else "f" * 40)
    assert (changed.completion_ids, changed.token_source) == (None, "none")
    assert changed.top_logprobs is None and changed.completion_logprobs is None
    assert record.prompt_ids == [1, 2**31] and record.choices[1].text == "t\x00"  # a copy


def test_storable_leaves_a_storable_record_alone_and_never_touches_an_id():
    from tracetap.storage.storable import storable

    record = _normal(0)
    record.choices[0].completion_logprobs = [-1, -0.5]  # ints and floats are numbers
    record.prompt_ids = []
    assert storable(record, "postgresql") == (record, [])
    record.episode_id, record.call_id = "e\x00" + "e" * 200, "c\x00"
    assert storable(record, "postgresql") == (record, [])
    surrogate = _normal(0)
    surrogate.model = "a\ud800b\U0001f600"
    fixed, notes = storable(surrogate, "sqlite")
    assert fixed.model == "a\ufffdb\U0001f600"
    assert notes == ["model: invalid characters replaced with U+FFFD"]
    assert fixed.error == MARK + notes[0]
    ids = _normal(0)
    ids.prompt_ids, ids.prompt_tokens = [1, "2"], -(2**63) - 1
    fixed, notes = storable(ids, "sqlite")
    assert notes == [f"prompt_tokens {-(2**63) - 1} out of range, not stored",
                     "prompt_ids: a token id outside int32, ids not stored"]
    bounds = _normal(0)
    bounds.prompt_ids, bounds.prompt_tokens = [-(2**31), 2**31 - 1], 2**31 - 1
    bounds.choices[0].completion_ids = [0, 2**31 - 1]
    assert storable(bounds, "postgresql") == (bounds, [])


def test_storable_marks_a_choice_whose_ids_it_dropped():
    from tracetap.storage.storable import storable

    record = _normal(0)
    record.choices[0].completion_ids = [2**40]
    fixed, _ = storable(record, "sqlite")
    assert fixed.ids_missing == UNSTORABLE_IDS and fixed.prompt_ids == [1, 2, 3]
    text = _normal(0)
    text.choices[0].text = "\ud800"
    fixed, _ = storable(text, "sqlite")
    assert fixed.ids_missing is None and fixed.choices[0].completion_ids == [4, 5]


def test_the_dead_letter_file_keeps_each_record_once_owner_only_and_logs_a_line_a_batch(
        tmp_path, caplog):
    import os
    import stat

    from tracetap.storage.quarantine import count, read
    from tracetap.storage.refusal import Altered, Refused

    path = tmp_path / "q" / "w.jsonl"
    quarantine = Quarantine(path)
    refused = [_poison("missing_seq"), _poison("missing_seq")]
    altered = _poison("nul")
    outcome = Outcome(refused=[Refused(r, "IntegrityError: seq") for r in refused],
                      altered=[Altered(altered, ["model: x", "request: y"])])
    assert quarantine.keep(Outcome(), "sqlite") == (0, 0, 0) and not path.exists()
    with caplog.at_level(logging.WARNING, logger="tracetap.quarantine"):
        assert quarantine.keep(outcome, "postgresql") == (2, 1, 0)
        assert quarantine.keep(outcome, "postgresql") == (0, 0, 0)  # a replay: kept already
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    entries = list(read(path))
    assert [(e.call_id, e.kind, e.reason, e.database) for e in entries] == [
        (refused[0].call_id, "refused", "IntegrityError: seq", "postgresql"),
        (refused[1].call_id, "refused", "IntegrityError: seq", "postgresql"),
        (altered.call_id, "altered", "model: x; request: y", "postgresql")]
    assert entries[0].episode_id == "poison-missing_seq" and entries[2].call() == altered
    assert count(tmp_path / "nowhere") == (0, 0)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines == [
        ("ERROR", f"QUARANTINED 2 calls the database refused (first: {refused[0].call_id} of "
                  f"episode poison-missing_seq: IntegrityError: seq); 2 kept in {path} "
                  "(tracetap quarantine list)"),
        ("WARNING", f"1 calls stored altered (first: {altered.call_id} of episode "
                    "poison-nul: model: x; request: y)"),
        ("ERROR", f"QUARANTINED 2 calls the database refused (first: {refused[0].call_id} of "
                  f"episode poison-missing_seq: IntegrityError: seq); 0 kept in {path} "
                  "(tracetap quarantine list)"),
        ("WARNING", f"1 calls stored altered (first: {altered.call_id} of episode "
                    "poison-nul: model: x; request: y)")]
    again = Quarantine(path)  # another process reads what is there before adding
    assert again.add([entries[0]]) == 0 and again.add([entries[0]]) == 0
    with open(path, "ab") as cut:
        cut.write(b'{"call_id": "cut by a cra')
    assert [e.call_id for e in read(path)] == [e.call_id for e in entries]


def test_a_full_dead_letter_file_counts_what_it_leaves_out_and_says_so(tmp_path, caplog):
    from tracetap.storage.quarantine import entry
    from tracetap.storage.refusal import Refused

    records = [_poison("missing_seq") for _ in range(3)]
    one = len(msgspec_line(entry(records[0], "refused", "r", "sqlite")))
    quarantine = Quarantine(tmp_path / "q.jsonl", max_bytes=2 * one + one // 2)
    outcome = Outcome(refused=[Refused(r, "r") for r in records])
    with caplog.at_level(logging.ERROR, logger="tracetap.quarantine"):
        assert quarantine.keep(outcome, "sqlite") == (2, 0, 1)
    assert quarantine.overflow == 1
    assert (tmp_path / "q.jsonl").stat().st_size <= 2 * one + one // 2
    assert caplog.records[-1].getMessage() == (
        f"the dead-letter file {tmp_path / 'q.jsonl'} is full ({2 * one + one // 2} bytes): "
        "1 refused calls are lost (counted as dropped)")
    # An entry that fits exactly (its own length: each entry carries the time it was made,
    # whose spelling can be a byte longer or shorter than another's).
    kept = entry(records[0], "refused", "r", "sqlite")
    exact = Quarantine(tmp_path / "exact.jsonl", max_bytes=len(msgspec_line(kept)))
    assert exact.add([kept]) == 1


def msgspec_line(e) -> bytes:
    import msgspec

    return msgspec.json.encode(e) + b"\n"


def test_journal_payloads_that_no_longer_decode_are_kept_as_their_bytes(tmp_path, caplog):
    import msgspec

    from tracetap.storage.quarantine import count, read_all

    good = _normal(1)
    payloads = [msgspec.msgpack.encode(good), b"\xc1junk", b"\xc1junk", b"\xc1other"]
    quarantine = Quarantine.beside(tmp_path / "journal")
    decode = msgspec.msgpack.Decoder(CallRecord).decode
    with caplog.at_level(logging.ERROR, logger="tracetap.quarantine"):
        records, new = quarantine.decoded(payloads, decode, "sqlite")
        again = quarantine.decoded(payloads[:2], decode, "sqlite")
    assert records == [good] and new == 2 and again == ([good], 0)
    assert quarantine.path == tmp_path / "quarantine" / "journal.jsonl"
    kept = read_all(tmp_path)
    assert [e.record for e in kept] == [b"\xc1junk", b"\xc1other"]
    assert all(e.call_id.startswith("undecodable-") and len(e.call_id) == 36 for e in kept)
    assert kept[0].kind == "refused" and kept[0].database == "sqlite"
    assert kept[0].reason.startswith("undecodable journal record: ")
    assert count(tmp_path) == (2, 0)
    assert [r.getMessage() for r in caplog.records] == [
        f"QUARANTINED 2 journal records that do not decode; kept in {quarantine.path}"]
    assert quarantine.decoded([], decode, "sqlite") == ([], 0)


def test_every_workers_file_is_read_oldest_first(tmp_path):
    from tracetap.storage.quarantine import entry, read_all

    first, second, third = (_poison("missing_seq") for _ in range(3))
    a, b = Quarantine.beside(tmp_path / "journal-b"), Quarantine.beside(tmp_path / "journal-a")
    e1, e2, e3 = (entry(r, "refused", "r", "sqlite") for r in (first, second, third))
    e1.quarantined_at, e2.quarantined_at, e3.quarantined_at = 1.0, 2.0, 3.0
    a.add([e1, e3])
    b.add([e2])
    altered = entry(_poison("nul"), "altered", "x", "sqlite")
    b.add([altered])
    assert [e.call_id for e in read_all(tmp_path)][:3] == [first.call_id, second.call_id,
                                                           third.call_id]
    from tracetap.storage.quarantine import count
    assert count(tmp_path) == (3, 1)


def test_an_entry_added_after_a_line_cut_by_a_crash_is_kept_and_counted_in_the_bound(tmp_path):
    """A crash mid-write leaves a line without its newline: the next process's entries
    start on a line of their own (glued to the cut one, both would be unreadable), the
    entries after a cut line are still read, and the newline counts in the bound."""
    from tracetap.storage.quarantine import entry, read

    path = tmp_path / "q.jsonl"
    first, second, third = (entry(_poison("missing_seq"), "refused", "r", "sqlite")
                            for _ in range(3))
    assert Quarantine(path).add([first]) == 1
    with open(path, "ab") as cut:
        cut.write(b'{"call_id": "cut by a cra')
    size = path.stat().st_size
    line = msgspec_line(second)
    tight = Quarantine(path, max_bytes=size + len(line))  # no room for the newline too
    assert tight.add([second]) == 0 and tight.overflow == 1
    assert path.stat().st_size == size
    assert Quarantine(path, max_bytes=size + 1 + len(line)).add([second]) == 1
    assert path.read_bytes() == msgspec_line(first) + b'{"call_id": "cut by a cra\n' + line
    assert Quarantine(path).add([third]) == 1  # the file ends in a newline: none added
    assert path.read_bytes().endswith(b"cra\n" + line + msgspec_line(third))
    assert [e.call_id for e in read(path)] == [first.call_id, second.call_id, third.call_id]


def test_a_new_process_counts_what_the_file_holds_against_its_bound(tmp_path):
    from tracetap.storage.quarantine import entry, read

    path = tmp_path / "q.jsonl"
    first, second = (entry(_poison("missing_seq"), "refused", "r", "sqlite") for _ in range(2))
    Quarantine(path).add([first])
    held = path.stat().st_size
    again = Quarantine(path, max_bytes=held + len(msgspec_line(second)) - 1)
    assert again.add([second]) == 0 and again.overflow == 1
    assert [e.call_id for e in read(path)] == [first.call_id]


def test_the_file_beside_a_journal_takes_its_bound_and_makes_its_folders(tmp_path):
    from tracetap.storage.quarantine import entry

    first, second = (entry(_poison("missing_seq"), "refused", "r", "sqlite") for _ in range(2))
    data_dir = tmp_path / "not" / "made" / "yet"
    quarantine = Quarantine.beside(data_dir / "journal", max_bytes=len(msgspec_line(first)))
    assert quarantine.path == data_dir / "quarantine" / "journal.jsonl"
    assert quarantine.add([first]) == 1 and quarantine.path.exists()
    assert quarantine.add([second]) == 0 and quarantine.overflow == 1  # its bound, not 1 GiB


def test_each_full_batch_counts_only_its_own_lost_records(tmp_path, caplog):
    from tracetap.storage.quarantine import entry
    from tracetap.storage.refusal import Refused

    records = [_poison("missing_seq") for _ in range(3)]
    one = len(msgspec_line(entry(records[0], "refused", "r", "sqlite")))
    quarantine = Quarantine(tmp_path / "q.jsonl", max_bytes=one + one // 2)
    with caplog.at_level(logging.ERROR, logger="tracetap.quarantine"):
        assert quarantine.keep(Outcome(refused=[Refused(records[0], "r"),
                                                Refused(records[1], "r")]), "sqlite") == (1, 0, 1)
        assert quarantine.keep(Outcome(refused=[Refused(records[2], "r")]),
                               "sqlite") == (0, 0, 1)
    assert quarantine.overflow == 2
    assert caplog.records[-1].getMessage().endswith(": 1 refused calls are lost (counted as "
                                                    "dropped)")


def test_the_count_adds_every_workers_file_and_skips_one_it_cannot_read(tmp_path):
    from tracetap.storage.quarantine import count, directory_of, entry

    (directory_of(tmp_path) / "a.jsonl").mkdir(parents=True)  # read first: not a file
    for journal in ("journal-b", "journal-c"):
        Quarantine.beside(tmp_path / journal).add([
            entry(_poison("missing_seq"), "refused", "r", "sqlite"),
            entry(_poison("nul"), "altered", "x", "sqlite"),
            entry(_poison("nul"), "altered", "x", "sqlite")])
    assert count(tmp_path) == (2, 4)


def test_an_altered_copy_refused_again_is_quarantined_with_its_own_reason_and_an_outage_raises():
    """The second try (storable's copy) is judged like the first: refused again, the
    record is quarantined with the reason the copy got; an outage then is raised, for the
    writer to retry the batch, never taken as a refusal."""
    from tracetap.storage.refusal import Refused

    class Engine:
        class dialect:
            name = "postgresql"

    record = _poison("nul")  # storable replaces the NULs: a second try is made
    tries = []

    def inserting(second):
        async def insert(engine, records):
            tries.append(records[0].model)
            if len(tries) == 1:
                raise ValueError("NUL")
            raise second
        return insert

    outcome = asyncio.run(write_batch(Engine(), [record], inserting(ValueError("again"))))
    assert tries == ["m\x00", "m\ufffd"]
    assert outcome == Outcome(refused=[Refused(record, "ValueError: again")])
    tries.clear()
    with pytest.raises(ConnectionResetError):
        asyncio.run(write_batch(Engine(), [record], inserting(ConnectionResetError("gone"))))
    assert len(tries) == 2


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_storable_cuts_text_to_the_lengths_the_migrated_database_holds(db_url):
    """The limits storable cuts to are the columns' in the database the migrations made,
    for every length-limited column of calls and choices (a limit read wrong would cut
    nothing, or too much)."""
    from sqlalchemy import text

    from tracetap.storage.storable import _lengths
    from tracetap.storage.tables import Call, Choice

    async def limits():
        engine = create_engine(db_url)
        try:
            async with engine.connect() as conn:
                rows = await conn.execute(text(
                    "SELECT table_name, column_name, character_maximum_length FROM "
                    "information_schema.columns WHERE table_name IN ('calls', 'choices') "
                    "AND character_maximum_length IS NOT NULL"))
                return {(t, c): n for t, c, n in rows}
        finally:
            await engine.dispose()

    found = asyncio.run(limits())
    ours = {**{("calls", c): n for c, n in _lengths(Call.__table__).items()},
            **{("choices", c): n for c, n in _lengths(Choice.__table__).items()}}
    assert ours == found and ("calls", "model") in ours  # model: 256, as the note says


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_storable_keeps_counts_at_the_bounds_and_drops_one_past(dialect):
    from tracetap.storage.storable import storable

    low, high = (-(2**31), 2**31 - 1) if dialect == "postgresql" else (-(2**63), 2**63 - 1)
    at = _normal(0)
    at.prompt_tokens, at.completion_tokens = low, high
    assert storable(at, dialect) == (at, [])
    past = _normal(0)
    past.prompt_tokens, past.completion_tokens = low - 1, high + 1
    fixed, notes = storable(past, dialect)
    assert (fixed.prompt_tokens, fixed.completion_tokens) == (None, None)
    assert notes == [f"prompt_tokens {low - 1} out of range, not stored",
                     f"completion_tokens {high + 1} out of range, not stored"]


def test_storable_drops_every_copy_of_ids_it_cannot_store_and_says_where_they_came_from():
    """Ids not stored means none at all, in either form, and their source says none."""
    from tracetap.storage.codec import pack_ids
    from tracetap.storage.storable import storable

    record = _normal(0)
    record.prompt_ids, record.prompt_ids_packed = [1, 2**40], pack_ids([1, 2])
    record.prompt_source = "engine"
    record.choices[0].completion_ids, record.choices[0].token_source = [2**40], "engine"
    fixed, _ = storable(record, "sqlite")
    assert (fixed.prompt_ids, fixed.prompt_ids_packed, fixed.prompt_source) == (
        None, None, "none")
    assert (fixed.choices[0].completion_ids, fixed.choices[0].token_source) == (None, "none")
    assert fixed.ids_missing == UNSTORABLE_IDS


def test_storable_notes_an_error_it_fixed_after_the_fixed_text():
    """The call's own error text, if it needed fixing too, is kept fixed before the note:
    the note never brings the unstorable original back."""
    from tracetap.storage.storable import storable

    record = _normal(0)
    record.error = "upstream said \ud800no"
    fixed, notes = storable(record, "sqlite")
    assert notes == ["error: invalid characters replaced with U+FFFD"]
    assert fixed.error == "upstream said \ufffdno; " + MARK + notes[0]
    fixed.error.encode("utf-8")  # storable now


def test_storable_drops_top_logprobs_json_cannot_hold_even_if_msgpack_can():
    """Stored as JSON, journaled as msgpack: each encoder is asked (a key that is not a
    string is msgpack's but not JSON's)."""
    import msgspec

    from tracetap.storage.storable import storable

    record = _normal(0)
    record.choices[0].top_logprobs = [{None: -1.0}]
    msgspec.msgpack.encode(record.choices[0].top_logprobs)  # msgpack takes it
    fixed, notes = storable(record, "sqlite")
    assert fixed.choices[0].top_logprobs is None
    assert notes == ["choices[0].top_logprobs: not encodable, not stored"]


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_storable_names_invalid_characters_as_such_unless_a_nul_was_what_postgres_refused(
        dialect):
    from tracetap.storage.storable import storable

    record = _normal(0)
    record.model = "m\ud800"  # no NUL: on either database, the lone surrogate
    record.choices[0].text = "a\x00\ud800"  # a NUL too: only Postgres refuses it
    fixed, notes = storable(record, dialect)
    assert notes == ["model: invalid characters replaced with U+FFFD",
                     "choices[0].text: " + ("NUL replaced with U+FFFD" if dialect == "postgresql"
                                            else "invalid characters replaced with U+FFFD")]
    assert fixed.model == "m\ufffd"


def test_quarantine_alone_shows_its_commands_and_list_and_show_print_exactly(tmp_path, capsys):
    """`tracetap quarantine` alone is its help (exit 0); `list` is one tab-separated line
    per record, its time in UTC, its episode as JSON cut to 80 characters; `show` is
    indented JSON in ASCII whatever the record holds."""
    from tracetap.cli import main
    from tracetap.storage.quarantine import entry

    assert main(["quarantine"]) == 0
    usage = capsys.readouterr().out
    assert usage.startswith("usage: tracetap quarantine [-h] SUBCOMMAND ...\n")
    assert "\n    list      one line per kept record" in usage
    record = _poison("nul")
    record.episode_id, record.model = "é" * 100, "modèle"
    kept = entry(record, "altered", "model: x", "postgresql")
    kept.quarantined_at = 86400.5
    Quarantine.beside(tmp_path / "journal").add([kept])
    assert main(["quarantine", "list", "--data-dir", str(tmp_path)]) == 0
    line, summary = capsys.readouterr().out.splitlines()
    assert line.split("\t") == ["1970-01-02T00:00:00+00:00", "altered", record.call_id,
                                json.dumps("é" * 100)[:80], "model: x"]
    assert len(line.split("\t")[3]) == 80
    assert summary == "1 records: 0 refused (not stored), 1 stored altered"
    assert main(["quarantine", "show", record.call_id, "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.isascii() and "mod\\u00e8le" in out
    assert out.splitlines()[:2] == ["{", f'  "call_id": "{record.call_id}",']
    assert json.loads(out)["record"]["model"] == "modèle"


def test_a_one_byte_cut_line_is_ended_once_however_many_entries_follow(tmp_path):
    from tracetap.storage.quarantine import entry, read

    path = tmp_path / "q.jsonl"
    path.write_bytes(b"{")  # the crash came after the first byte
    first, second = (entry(_poison("missing_seq"), "refused", "r", "sqlite") for _ in range(2))
    quarantine = Quarantine(path)
    assert quarantine.add([first]) == 1 and quarantine.add([second]) == 1
    assert path.read_bytes() == b"{\n" + msgspec_line(first) + msgspec_line(second)
    assert [e.call_id for e in read(path)] == [first.call_id, second.call_id]
