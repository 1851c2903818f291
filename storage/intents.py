"""Intents: every call a replica admits is known to the shared database before it is
answered, without the request path waiting for the database.

``admit`` queues a small row (call id, episode, replica) and wakes a background task
that writes it at once, beside the call's upstream request; the intents admitted while a
write is in flight are the next write's batch. The call's answer waits for its row only
if it has not landed by then (``wait``; bounded: a database that is slow); past the
bound, or while the database is down, the answer goes out and the call counts as
``late``. Each ``heartbeat`` seconds the replica's lease
(``replicas`` row) is renewed: ``settled_at``, the time before which every call it
admitted has its intent stored. Export holds back an episode that still has an intent
without its call row, or that finished after an open replica's ``settled_at``
(storage.replicas), so a call answered from a journal that never reached the database
is waited for, never exported as missing.

A process that restarts on a journal finds the intents its previous life left: once the
journal is replayed, those still without a call row were cut by the death (their
records were never journaled) and become tombstones (``lost``); until then its lease
does not move (``ready``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

from sqlalchemy import and_, delete, exists, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.storage.engine import create_engine, one_statement
from tracetap.storage.held_insert import HeldInsert
from tracetap.storage.journal import ADOPTED_FILE, REPLICA_FILE
from tracetap.storage.lease_sql import CLEANUP, RENEW_NOT_READY, RENEW_READY, lease_args
from tracetap.storage.records import CallRecord
from tracetap.storage.rows import dialect_insert, insert_ignoring_duplicates
from tracetap.storage.tables import Call, CallIntent, Replica
from tracetap.storage.tombstones import LOST

log = logging.getLogger("tracetap.intents")
Write = Callable[[bytes], Awaitable[object]]

OPEN, CLOSED, GONE = "open", "closed", "lost"  # a lease's states
_BATCH = 5000  # intents per transaction
_MAX_QUEUED = 200_000  # past this (a long outage) intents are not kept; the lease stays
_CLEANUP_SECONDS = 5.0  # how often intents whose call row is stored are deleted
_LOG_EVERY = 1000  # late answers: the first is logged, then one in this many
_INTENT_COLUMNS = ("call_id", "episode_id", "replica", "incarnation", "admitted_at")


class Ending(Protocol):
    """A call whose stream is relayed: its id, and whether its end has been seen."""

    call_id: str
    done: bool


def replica_id(journal_dir: str | os.PathLike) -> str:
    """The id of the replica that owns this journal directory (made once, then kept: a
    restart on the same journal is the same replica)."""
    path = Path(journal_dir) / REPLICA_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        value = f"{os.uname().nodename[:40]}-{os.urandom(6).hex()}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value + "\n")
        return value


def intents_engine(url: str) -> AsyncEngine:
    """The intents' own connections (Postgres): what a short call's answer may wait for
    is one statement. Their commits do not wait for the WAL's flush (an intent lost with
    a database crash leaves its call to the replica's journal and lease, as a late one),
    and no ping precedes each use (a broken connection fails one write, retried)."""
    return create_engine(url, pool_size=2, max_overflow=2, pool_pre_ping=False,
                         connect_args={"server_settings": {"synchronous_commit": "off"}})


def lost_tombstone(call_id: str, episode_id: str | None, replica: str,
                   admitted_at: float, reason: str) -> CallRecord:
    """The row a call leaves when its replica died before its record was journaled (a
    stream cut by the death), or was declared lost: its episode is marked infra."""
    return CallRecord(call_id=call_id, episode_id=episode_id, instance=replica[:64],
                      endpoint="", status=LOST, error=reason[:500],
                      t_start=admitted_at)


class Intents:
    """One process's intents and its replica's lease (see the module's docstring)."""

    def __init__(self, engine: AsyncEngine, replica: str, *, journal: str | None = None,
                 directory: Path | None = None, wait: float = 0.5, heartbeat: float = 1.0,
                 owns_engine: bool = False):
        self.engine = engine
        self.owns_engine = owns_engine  # disposed by close (intents_engine)
        self.directory = directory  # the journal's: replicas it adopted are named there
        self.replica = replica
        self.incarnation = os.urandom(8).hex()
        self.journal = journal
        self.wait_seconds = wait
        self.heartbeat = heartbeat
        self.ready = False  # the previous life's intents resolved: the lease may move
        self.late = 0  # answers given before their intent was stored
        self.not_kept = 0  # intents not queued (past _MAX_QUEUED)
        self.healthy = True
        self._queue: list[dict] = []  # in admission order
        self._unlanded: dict[str, asyncio.Future | None] = {}  # same order
        self._pinned: float | None = None  # the first admission whose intent was not kept
        self._wake = asyncio.Event()  # the first intent queued, or a heartbeat due
        self._task: asyncio.Task | None = None
        self._cleaned = 0.0
        self._uncleaned = 0  # cleanups still due (``flush``)
        self._renewed = -float("inf")  # monotonic time of the last renewal
        self._started = time.time()
        self._insert = insert_ignoring_duplicates(engine.dialect.name, CallIntent.__table__)
        # What every call waits for: on Postgres, on a connection kept for it.
        self._held = HeldInsert(engine, CallIntent.__table__, _INTENT_COLUMNS) \
            if engine.dialect.name == "postgresql" else None

    # -- the request path: no await on the database --------------------------------
    def admit(self, call_id: str, episode_id: str | None) -> None:
        """Queue the intent of a call of ``episode_id`` (untagged calls have none)."""
        if episode_id is None:
            return
        now = time.time()
        if len(self._queue) >= _MAX_QUEUED:
            self.not_kept += 1
            if self._pinned is None:
                self._pinned = now
                log.error("%d intents waiting for the database: later ones are not kept; "
                          "this replica's lease stays at %.3f until it restarts",
                          len(self._queue), now)
            return
        self._queue.append({"call_id": call_id, "episode_id": episode_id,
                            "replica": self.replica, "incarnation": self.incarnation,
                            "admitted_at": now})
        self._unlanded[call_id] = None
        if len(self._queue) == 1:  # the writer gathers a batch from here
            self._wake.set()

    def landed(self, call_id: str) -> bool:
        return call_id not in self._unlanded

    async def wait(self, call_id: str) -> None:
        """Until the call's intent is stored, at most ``wait`` seconds (not at all while
        the database is failing): the answer's end waits here."""
        if call_id not in self._unlanded:
            return
        if not self.healthy:
            self.late += 1
            return
        future = self._unlanded[call_id]
        if future is None:
            future = self._unlanded[call_id] = asyncio.get_running_loop().create_future()
        try:
            # Resumed a pass of the loop sooner than through wait_for's wrapper; shielded,
            # the bound never cancels the future the writer will resolve.
            async with asyncio.timeout(self.wait_seconds):
                await asyncio.shield(future)
        except TimeoutError:
            self.late += 1
            if self.late % _LOG_EVERY == 1:
                log.warning("call %s answered before its intent was stored (%.1f s; %d so "
                            "far): its episode waits for this replica's lease", call_id,
                            self.wait_seconds, self.late)

    def before_end(self, call: Ending, write: Write) -> Write:
        """``write`` for a stream's pieces: the piece that ends it (``call.done``: the
        record is journaled by then) waits for the call's intent first."""
        if call.call_id not in self._unlanded:
            return write

        async def written(piece: bytes) -> object:
            if call.done:
                await self.wait(call.call_id)
            return await write(piece)
        return written

    # -- the background task ---------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="tracetap-intents")

    async def close(self, *, clean: bool) -> None:
        """Stop; ``clean``: every record this process took is stored, so its lease
        closes (export stops waiting for it)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            if clean:  # every call it admitted is stored: intents still queued are moot
                await asyncio.wait_for(self._renew(state=CLOSED), 5)
                await asyncio.wait_for(self._cleanup(), 5)
        except Exception as exc:
            log.warning("could not close this replica's lease: %s", exc)
        finally:  # not clean: its journal holds records, the lease waits for its restart
            if self._held is not None:
                await self._held.release()
            if self.owns_engine:
                await self.engine.dispose()

    async def _run(self) -> None:
        backoff = 0.2
        while True:
            # Asleep only while nothing is queued: intents queued during a flush are the
            # next batch's at once (admit wakes the writer only when the queue was empty).
            if not self._queue:
                # Woken in one pass of the loop after admit's set (wait_for's wrapper task
                # took three: passes in which the call's request went upstream and its
                # intent did not, so the intent's round trip ended after the reply's).
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.heartbeat):
                        await self._wake.wait()
            self._wake.clear()
            # Written at once, not gathered for a while: the write then runs beside the
            # call's upstream request, and its answer finds the intent stored (a gather
            # put the statement's round trip between the reply and the answer). Under load
            # a batch still forms: what is admitted during a write is the next batch, and
            # this yield lets the calls admitted in the same pass of the loop join.
            await asyncio.sleep(0)
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.healthy:
                    log.error("cannot store call intents (%s); answers go out without "
                              "waiting and export waits for this replica", exc)
                self.healthy = False
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            self.healthy, backoff = True, 0.2

    async def flush(self) -> None:
        """Store what is queued, and renew the lease when it is due (one transaction)."""
        batch = self._queue[:_BATCH]
        due = time.monotonic() - self._renewed >= self.heartbeat
        if not batch and not due:
            return
        await self._renew(batch=batch, lease=due)
        del self._queue[:len(batch)]
        for row in batch:
            future = self._unlanded.pop(row["call_id"], None)
            if future is not None and not future.done():
                future.set_result(None)
        if batch:
            # This interval's cleanup and the next (the call rows of intents stored just
            # before a cleanup are written after it); an idle replica then stops asking.
            # An intent whose row comes later still is gone at the next call's cleanup
            # or at a clean close, and holds nothing meanwhile (its row is stored).
            self._uncleaned = 2
        if self._uncleaned and time.monotonic() - self._cleaned > _CLEANUP_SECONDS:
            self._cleaned = time.monotonic()
            await self._cleanup()
            self._uncleaned -= 1

    async def _renew(self, batch: list[dict] = (), state: str = OPEN,
                     lease: bool = True) -> None:
        """Store ``batch``; with ``lease``, renew the lease too (at most once a heartbeat:
        an intent alone is one statement, what a short call's answer may wait for)."""
        started = time.monotonic()
        now = time.time()  # read before the transaction: admissions after it are not covered
        settled = now if len(self._queue) <= len(batch) else self._queue[len(batch)][
            "admitted_at"]
        if self._pinned is not None:
            settled = min(settled, self._pinned)
        values = {"incarnation": self.incarnation, "journal": self.journal,
                  "state": state, "heartbeat_at": now}
        dialect = self.engine.dialect.name
        # Each statement alone, in autocommit (one round trip, where a transaction takes
        # three): the intents first, then the lease, so a lease never covers intents
        # that are not stored (a failure between the two leaves the lease behind: late,
        # never ahead).
        if batch and self._held is not None:
            await self._held.run(batch)
            batch = ()
        if not batch and not lease:
            return
        if self._held is not None:  # Postgres: the lease on the kept connection
            await self._held.execute(
                RENEW_READY if self.ready else RENEW_NOT_READY,
                *lease_args(self.replica, self._started, settled, **values))
        else:
            async with one_statement(self.engine) as conn:
                if batch:
                    await conn.execute(self._insert, list(batch))
                if lease:
                    upsert = dialect_insert(dialect, Replica.__table__).values(
                        replica=self.replica, started_at=self._started,
                        settled_at=settled, **values)
                    # A restarted replica's lease stays where its previous life left it
                    # until that life's intents are resolved (``ready``).
                    changes = {**values, **({"settled_at": settled} if self.ready else {})}
                    await conn.execute(upsert.on_conflict_do_update(
                        index_elements=["replica"], set_=changes))
        if lease:
            self._renewed = started

    async def _cleanup(self) -> None:
        """Delete this replica's intents whose call row is stored."""
        if self._held is not None:
            await self._held.execute(CLEANUP, self.replica)
            return
        stored = exists().where(Call.call_id == CallIntent.call_id)
        async with one_statement(self.engine) as conn:
            await conn.execute(delete(CallIntent).where(
                CallIntent.replica == self.replica, stored))

    # -- a restart on a journal --------------------------------------------------------
    async def previous(self) -> list[CallRecord]:
        """Tombstones for the intents an earlier life of this replica (or a replica whose
        journal it adopted: ``serve --workers`` run with fewer workers) left without a
        call row; call once its journal is replayed (the records it held are stored).
        The adopted replicas' leases are closed."""
        reason = "the replica stopped before this call's record was journaled (a crash)"
        stones = await leftovers(self.engine, self.replica, exclude=self.incarnation,
                                 reason=reason)
        adopted = self.directory / ADOPTED_FILE if self.directory is not None else None
        if adopted is not None and adopted.exists():
            for other in set(adopted.read_text().split()):
                stones += await leftovers(self.engine, other, reason=reason)
                await set_state(self.engine, other, CLOSED)
            adopted.unlink()
        return stones


async def leftovers(engine: AsyncEngine, replica: str, *, exclude: str | None = None,
                    reason: str) -> list[CallRecord]:
    """Tombstones for ``replica``'s intents that have no call row (those of incarnation
    ``exclude``, the running one, left out)."""
    query = select(CallIntent.call_id, CallIntent.episode_id, CallIntent.admitted_at).where(
        CallIntent.replica == replica,
        ~exists().where(Call.call_id == CallIntent.call_id))
    if exclude is not None:
        query = query.where(CallIntent.incarnation != exclude)
    async with engine.connect() as conn:
        rows = (await conn.execute(query.order_by(CallIntent.admitted_at))).all()
    return [lost_tombstone(r.call_id, r.episode_id, replica, r.admitted_at, reason)
            for r in rows]


async def set_state(engine: AsyncEngine, replica: str, state: str) -> bool:
    """Mark a replica's lease (closed: replayed elsewhere; lost: given up on)."""
    async with engine.begin() as conn:
        result = await conn.execute(update(Replica).where(
            and_(Replica.replica == replica)).values(state=state, settled_at=time.time()))
        return result.rowcount == 1


class NoIntents:
    """No intents and no lease (SQLite: one host, whose journal sits beside its database
    file; docs/operations.md)."""

    ready = True
    late = 0

    def admit(self, call_id: str, episode_id: str | None) -> None:
        pass

    def landed(self, call_id: str) -> bool:
        return True

    async def wait(self, call_id: str) -> None:
        pass

    def start(self) -> None:
        pass

    async def close(self, *, clean: bool) -> None:
        pass

    async def previous(self) -> list[CallRecord]:
        return []

    def before_end(self, call: Ending, write: Write) -> Write:
        return write
