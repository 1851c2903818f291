"""What the database knows of the replicas' calls not stored yet, for export and for the
operator (``tracetap db replicas``, ``db replay``, ``db lost``).

An episode is *settled* when every call admitted to it is stored: no intent of it is
left without its call row (storage.intents), and it finished before every open
replica's ``settled_at`` (a replica that answered a call before its intent was stored,
or stopped answering the database, holds back every episode finished since). Export
exports only settled episodes, and its watermark stays below the first one it held.

A replica that never comes back is resolved by the operator: ``replay`` writes its
journal directory (copied from its host or volume) into the database, turns what its
intents still lack into tombstones, and closes its lease; ``lose`` gives up on it:
tombstones for its intents without a row (status ``record_lost``, integrity infra), and
its lease marked lost.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
from sqlalchemy import delete, exists, func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tracetap.storage.conversation import Readers
from tracetap.storage.intents import CLOSED, GONE, OPEN, REPLICA_FILE, leftovers, set_state
from tracetap.storage.journal import Journal
from tracetap.storage.refusal import write_batch
from tracetap.storage.tables import Call, CallIntent, Episode, Replica
from tracetap.storage.writer import Writer, WriterObserver

STALE_SECONDS = 10.0  # a lease not renewed for this long: the replica is gone or cut off


class Holds(msgspec.Struct):
    """Why episodes are not settled: the earliest open replica's ``settled_at`` (None:
    no open replica) and the episodes with intents still without a call row."""

    settled: float | None = None
    waiting: dict[str, float | None] = {}  # episode id: its finished_at
    replicas: list[str] = []  # the open replicas holding episodes back, earliest first

    def held(self, episode_id: str, finished_at: float | None) -> bool:
        if episode_id in self.waiting:
            return True
        return (self.settled is not None and finished_at is not None
                and finished_at > self.settled)

    @property
    def floor(self) -> float | None:
        """The finished_at below which no episode is held (the watermark's ceiling)."""
        times = [f for f in self.waiting.values() if f is not None]
        if self.settled is not None:
            times.append(self.settled)
        return min(times, default=None)


async def holds(conn: AsyncConnection) -> Holds:
    """The holds on export now (two small queries: open leases; pending intents)."""
    leases = (await conn.execute(select(Replica.replica, Replica.settled_at).where(
        Replica.state == OPEN).order_by(Replica.settled_at))).all()
    pending = (await conn.execute(
        select(CallIntent.episode_id, Episode.finished_at).distinct()
        .join(Episode, Episode.id == CallIntent.episode_id, isouter=True)
        .where(~exists().where(Call.call_id == CallIntent.call_id)))).all()
    return Holds(settled=leases[0].settled_at if leases else None,
                 waiting={r.episode_id: r.finished_at for r in pending},
                 replicas=[r.replica for r in leases])


async def wait_settled(engine: AsyncEngine, since: float, timeout: float = 3.0) -> None:
    """Give the live replicas' leases (renewed each second) ``timeout`` seconds to pass
    ``since``, so that an export just after a finish is not held by a heartbeat's lag; a
    replica that is gone or cut off (no renewal for STALE_SECONDS) is not waited for."""
    deadline = time.monotonic() + timeout
    while True:
        async with engine.connect() as conn:
            lagging = (await conn.execute(select(func.count()).select_from(Replica).where(
                Replica.state == OPEN, Replica.settled_at < since,
                Replica.heartbeat_at > time.time() - STALE_SECONDS))).scalar()
        if not lagging or time.monotonic() >= deadline:
            return
        await asyncio.sleep(0.1)  # polling leases other processes renew


class ReplicaStatus(msgspec.Struct, kw_only=True):
    replica: str
    state: str
    journal: str | None
    heartbeat_age: float  # seconds since its lease was renewed
    settled_at: float
    waiting: int  # its intents without a call row


async def status(engine: AsyncEngine) -> list[ReplicaStatus]:
    async with engine.connect() as conn:
        waiting = dict((await conn.execute(
            select(CallIntent.replica, func.count()).where(
                ~exists().where(Call.call_id == CallIntent.call_id))
            .group_by(CallIntent.replica))).all())
        rows = (await conn.execute(select(Replica).order_by(Replica.replica))).all()
    now = time.time()
    return [ReplicaStatus(replica=r.replica, state=r.state, journal=r.journal,
                          heartbeat_age=now - r.heartbeat_at, settled_at=r.settled_at,
                          waiting=int(waiting.get(r.replica, 0))) for r in rows]


class Resolved(msgspec.Struct, kw_only=True):
    replica: str
    replayed: int = 0  # records written from the journal
    tombstones: int = 0  # intents without a row, now tombstones


async def replay(engine: AsyncEngine, journal_dir: Path, *, force: bool = False,
                 readers: Readers | None = None) -> Resolved:
    """Write a dead replica's journal directory into the database, then resolve its
    intents and close its lease. Refused while its lease is renewed (it is running).
    ``readers``: each API's request shape, as the proxy's writer has them (its bodies cut
    at their messages, its calls indexed for search alike)."""
    replica = (journal_dir / REPLICA_FILE).read_text().strip() if (
        journal_dir / REPLICA_FILE).exists() else None
    if replica is not None:
        await _check_gone(engine, replica, force)
    journal = Journal(journal_dir, max_bytes=1 << 62)
    counted = _Counted()
    writer = Writer(engine, journal, observer=counted, readers=readers)
    await writer.flush()
    journal.close()
    done = Resolved(replica=replica or "", replayed=counted.written)
    if replica is not None:
        done.tombstones = await _resolve(engine, replica, "its replica stopped before the "
                                         "record was journaled; its journal was replayed")
        await set_state(engine, replica, CLOSED)
    return done


async def lose(engine: AsyncEngine, replica: str, *, force: bool = False) -> Resolved:
    """Give up on a replica: its intents without a row become tombstones (the calls
    are lost, their episodes infra) and its lease is marked lost."""
    await _check_gone(engine, replica, force)
    stones = await _resolve(engine, replica, "its replica was declared lost (tracetap db "
                                             "lost): the record never reached the database")
    await set_state(engine, replica, GONE)
    return Resolved(replica=replica, tombstones=stones)


class ReplicaRunning(Exception):
    """The replica's lease is being renewed: it is running."""


async def _check_gone(engine: AsyncEngine, replica: str, force: bool) -> None:
    async with engine.connect() as conn:
        row = (await conn.execute(select(Replica.heartbeat_at, Replica.state).where(
            Replica.replica == replica))).first()
    if row is None:
        if not force:
            raise LookupError(f"no replica {replica!r} in this database")
        return
    age = time.time() - row.heartbeat_at
    if row.state == OPEN and age < STALE_SECONDS and not force:
        raise ReplicaRunning(f"replica {replica!r} renewed its lease {age:.1f} s ago: it "
                             "is running (stop it first, or --force)")


async def _resolve(engine: AsyncEngine, replica: str, reason: str) -> int:
    """Tombstones for the replica's intents without a row; then its intents go."""
    stones = await leftovers(engine, replica, reason=reason)
    if stones:
        await write_batch(engine, stones)
    async with engine.begin() as conn:
        await conn.execute(delete(CallIntent).where(
            CallIntent.replica == replica, exists().where(Call.call_id == CallIntent.call_id)))
    return len(stones)


class _Counted(WriterObserver):
    """How many records a replay wrote."""

    def __init__(self):
        self.written = 0

    def records(self, outcome: str, count: int) -> None:
        if outcome in ("written", "replayed"):
            self.written += count
