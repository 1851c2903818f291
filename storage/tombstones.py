"""Tombstones: the row a call leaves when its record cannot be stored.

A record dropped because the journal was full, or refused by the database (kept in the
dead-letter file, ``storage.quarantine``), would otherwise leave no trace in its episode:
its reward would look as trustworthy as any other (``storage.integrity``). Its tombstone
is a call row with the same call id and only the small columns (episode, arrival order,
timings, HTTP status), status ``record_dropped`` or ``record_quarantined`` and the reason
as its error. Those columns are what a database accepts whatever the record held, and
trimmed to the columns' sizes; the episode id is kept as it is (a cut id would name
another episode), so a tombstone of a record refused for its episode id is refused too.

Durability: a dropped record's tombstone is journaled in a small slack the journal keeps
past its bound for them (``slack``), so it survives a crash like any record;
when that slack is full too it is only counted (``tracetap_records_total{outcome=
"dropped"}``) and logged. A quarantined record's tombstone is written right after its
batch, before the segment is deleted: a crash in between replays the segment, which is
refused again and writes it then.
"""

from __future__ import annotations

from tracetap.storage.records import CallRecord

DROPPED = "record_dropped"
QUARANTINED = "record_quarantined"
# A call its replica admitted (storage.intents) whose record never reached the journal: a
# stream cut by the replica's death, or a replica an operator declared lost.
LOST = "record_lost"
# What tombstones may use beyond the journal's bound (a tombstone is ~200 bytes): a 64th
# of it, at least SLACK_MIN.
SLACK_FRACTION = 64
SLACK_MIN = 64 << 10


def slack(max_bytes: int) -> int:
    return max(max_bytes // SLACK_FRACTION, SLACK_MIN)


def tombstone(record: CallRecord, status: str, reason: str) -> CallRecord:
    """The tombstone of ``record`` (DROPPED or QUARANTINED)."""
    return CallRecord(
        call_id=record.call_id[:36],
        episode_id=record.episode_id,  # never cut or changed: it would name another episode
        seq=record.seq if type(record.seq) is int and abs(record.seq) < 2**31 else 0,
        instance=_clean(record.instance, 64) or "",
        endpoint=_clean(record.endpoint, 32) or "",
        stream=record.stream,
        status=status,
        http_status=record.http_status if abs(record.http_status) < 2**31 else 0,
        error=reason[:500],
        t_start=record.t_start,
        t_end=record.t_end,
    )


def tombstones(records) -> int:
    """How many of ``records`` are tombstones."""
    return sum(1 for r in records if r.status in (DROPPED, QUARANTINED, LOST))


def _clean(value: str | None, size: int) -> str | None:
    """Cut to the column's size, without the characters a database refuses in text."""
    if value is None:
        return None
    return value.replace("\x00", "").encode("utf-8", "replace").decode("utf-8")[:size]
