"""The dead-letter file: records the database refused, kept whole with the reason.

One JSON line per record, in ``DATA_DIR/quarantine/<journal>.jsonl`` (one file per
journal, so ``serve --workers`` processes never share one). ``kind`` says what happened:
``refused`` (not stored at all) or ``altered`` (stored with the values the database could
not hold replaced; the line keeps it as captured). ``record`` is the record's journal
encoding (msgpack, base64 in JSON): ``tracetap quarantine show`` decodes it. A line is
written and fsynced before the journal segment that held the record is deleted, and a
replay of the same segment (a crash in between) does not add it twice.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import msgspec

from tracetap.storage.records import CallRecord
from tracetap.storage.refusal import Outcome

log = logging.getLogger("tracetap.quarantine")

KINDS = ("refused", "altered")
DIRECTORY = "quarantine"


class Entry(msgspec.Struct, kw_only=True):
    call_id: str
    episode_id: str | None = None
    kind: str  # KINDS
    reason: str  # the database's refusal, or what was altered
    quarantined_at: float
    database: str  # the dialect that refused it
    record: bytes  # msgpack of storage.records.CallRecord, as captured

    def call(self) -> CallRecord:
        return _decode_record(self.record)


_encode_line = msgspec.json.Encoder().encode
_decode_line = msgspec.json.Decoder(Entry).decode
_encode_record = msgspec.msgpack.Encoder().encode
_decode_record = msgspec.msgpack.Decoder(CallRecord).decode


def directory_of(data_dir: Path) -> Path:
    return Path(data_dir) / DIRECTORY


class Quarantine:
    """Appends to one dead-letter file; the writer that owns a journal owns its file.

    The file is bounded (``max_bytes``; the writer gives it its journal's size): an agent
    that sends nothing but records the database refuses must not fill the disk. Entries
    past the bound are not kept; ``overflow`` counts them (the writer counts the refused
    ones as dropped; an altered record is stored in the database all the same).
    """

    def __init__(self, path: Path, max_bytes: int = 1 << 30):
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.overflow = 0
        self._seen: set[tuple[str, str]] | None = None  # read on first add, not at start
        self._bytes = 0
        self._cut = False  # the file ends in a line cut by a crash

    @classmethod
    def beside(cls, journal_dir: Path, max_bytes: int = 1 << 30) -> Quarantine:
        """The dead-letter file of the journal in ``journal_dir`` (``DATA_DIR/journal``)."""
        journal_dir = Path(journal_dir)
        return cls(directory_of(journal_dir.parent) / f"{journal_dir.name}.jsonl", max_bytes)

    def add(self, entries: list[Entry]) -> int:
        """Append the entries not already there, while the file stays within its bound;
        returns how many were new and kept (``overflow`` counts those left out)."""
        if self._seen is None:
            self._seen = {(e.call_id, e.kind) for e in read(self.path)}
            self._bytes = self.path.stat().st_size if self.path.exists() else 0
            # A line cut by a crash has no newline: what is appended next must not be
            # glued to it (the pair would read as one broken line, and both be lost).
            self._cut = self._bytes > 0 and _last_byte(self.path) != b"\n"
            self._bytes += self._cut  # the newline that ends it, written with the next
        lines = []
        for e in entries:
            if (e.call_id, e.kind) in self._seen:
                continue
            line = _encode_line(e) + b"\n"
            if self._bytes + len(line) > self.max_bytes:
                self.overflow += 1
                continue
            self._bytes += len(line)
            self._seen.add((e.call_id, e.kind))
            lines.append(line)
        if not lines:
            return 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = memoryview(b"\n" * self._cut + b"".join(lines))
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while data:  # a write may take only part of it
                data = data[os.write(fd, data):]
            self._cut = False
            os.fsync(fd)  # rare, and the journal copy is deleted right after
        finally:
            os.close(fd)
        return len(lines)

    def keep(self, outcome: Outcome, database: str) -> tuple[int, int, int]:
        """Keep what a batch write refused or altered, and log it; returns how many
        refused and altered records were new (counted once: a replay after a crash
        finds them already kept), and how many refused ones the bound left out (lost)."""
        if not outcome.refused and not outcome.altered:
            return 0, 0, 0
        before = self.overflow
        refused = self.add([entry(r.record, "refused", r.reason, database)
                            for r in outcome.refused])
        lost = self.overflow - before
        altered = self.add([entry(a.record, "altered", "; ".join(a.notes), database)
                            for a in outcome.altered])
        # One line a batch, not one a record: a flood of hostile requests must not flood
        # the log (tracetap quarantine list names each).
        if outcome.refused:
            first = outcome.refused[0]
            log.error("QUARANTINED %d calls the database refused (first: %s of episode %s: "
                      "%s); %d kept in %s (tracetap quarantine list)", len(outcome.refused),
                      first.record.call_id, first.record.episode_id, first.reason, refused,
                      self.path)
        if outcome.altered:
            first = outcome.altered[0]
            log.warning("%d calls stored altered (first: %s of episode %s: %s)",
                        len(outcome.altered), first.record.call_id, first.record.episode_id,
                        "; ".join(first.notes))
        if lost:
            log.error("the dead-letter file %s is full (%d bytes): %d refused calls are lost "
                      "(counted as dropped)", self.path, self.max_bytes, lost)
        return refused, altered, lost

    def decoded(self, payloads: Iterable[bytes], decode: Callable[[bytes], CallRecord],
                database: str) -> tuple[list[CallRecord], int]:
        """The records of journal payloads; one that no longer decodes as a record
        (written by another version, say) is kept here as its bytes, not in the way.
        Returns the records and how many undecodable ones were new (those the bound
        leaves out are counted in ``overflow``)."""
        records, undecodable = [], []
        for payload in payloads:
            try:
                records.append(decode(payload))
            except msgspec.DecodeError as exc:
                undecodable.append(raw_entry(payload, f"undecodable journal record: {exc}",
                                             database))
        new = self.add(undecodable) if undecodable else 0
        if new:
            log.error("QUARANTINED %d journal records that do not decode; kept in %s",
                      new, self.path)
        return records, new


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def entry(record: CallRecord, kind: str, reason: str, database: str) -> Entry:
    return Entry(call_id=record.call_id, episode_id=record.episode_id, kind=kind,
                 reason=reason, quarantined_at=time.time(), database=database,
                 record=_encode_record(record))


def raw_entry(payload: bytes, reason: str, database: str) -> Entry:
    """A journal payload that is not a record any more: kept as its bytes, named by their
    hash (the same payload replayed again is the same entry)."""
    name = "undecodable-" + hashlib.sha256(payload).hexdigest()[:24]
    return Entry(call_id=name, kind="refused", reason=reason, quarantined_at=time.time(),
                 database=database, record=payload)


def read(path: Path) -> Iterator[Entry]:
    """The entries of one file, oldest first; a line cut by a crash is skipped."""
    try:
        lines = Path(path).read_bytes().splitlines()
    except FileNotFoundError:
        return
    for line in lines:
        try:
            yield _decode_line(line)
        except msgspec.DecodeError:
            continue


def count(data_dir: Path) -> tuple[int, int]:
    """How many records are kept refused and altered under ``data_dir``, without decoding
    them (for a page that shows the count on every load). A kind is a JSON value of its
    own: inside a string, its quotes would be escaped."""
    refused = altered = 0
    for path in sorted(directory_of(data_dir).glob("*.jsonl")):  # the same order each time
        try:
            data = path.read_bytes()
        except OSError:
            continue
        refused += data.count(b'"kind":"refused"')
        altered += data.count(b'"kind":"altered"')
    return refused, altered


def read_all(data_dir: Path) -> list[Entry]:
    """Every entry under ``data_dir`` (all workers' files), oldest first."""
    files = sorted(directory_of(data_dir).glob("*.jsonl"))
    return sorted((e for f in files for e in read(f)), key=lambda e: e.quarantined_at)
