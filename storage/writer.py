"""Write-behind writer: journal first, then batched idempotent inserts.

``submit`` is synchronous and never touches the database, so the request path only
pays for one journal append. A background task seals journal segments and writes
each in one transaction; a segment is deleted only after its commit. While the
database is down, segments accumulate on disk and are replayed when it returns.
An optional ``prepare`` step completes records just before they are written (the proxy
fills in token ids an engine did not return): off the request path, and it never fails
a write. It may hand records back to be offered again later (their engine cannot be
asked yet): those are journaled again before their segment is deleted, so they survive a
restart, and are offered again every ``hold_retry`` seconds. They may fill at most half
the journal; past that ``prepare`` is told not to hold any (``hold=False``).
A record the database refuses does not hold up the others: the batch is split until it
is alone (``storage.refusal``), and it goes to the dead-letter file (``storage.quarantine``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.storage import blocks
from tracetap.storage.conversation import Readers
from tracetap.storage.dedup import BlockCache
from tracetap.storage.journal import Journal, read_segment
from tracetap.storage.journal_record import decode as _decode
from tracetap.storage.journal_record import encode as _encode
from tracetap.storage.journal_record import pieces as _pieces
from tracetap.storage.quarantine import Quarantine
from tracetap.storage.records import CallRecord
from tracetap.storage.refusal import Outcome, write_batch
from tracetap.storage.rows import insert_calls
from tracetap.storage.storable import storable
from tracetap.storage.tombstones import DROPPED, QUARANTINED, slack, tombstone, tombstones

log = logging.getLogger("tracetap.writer")


class WriterObserver:
    """Hooks for metrics; the default does nothing."""

    def records(self, outcome: str, count: int) -> None: ...

    def db_write(self, seconds: float, count: int) -> None: ...

    def db_error(self) -> None: ...


class Writer:
    def __init__(
        self,
        engine: AsyncEngine,
        journal: Journal,
        *,
        flush_interval: float = 0.05,
        observer: WriterObserver | None = None,
        cache_records: int = 50_000,
        batch_records: int = 256,
        prepare: Callable[..., Awaitable[list[CallRecord] | None]] | None = None,
        quarantine: Quarantine | None = None,
        hold_retry: float = 0.5,
        search_index: bool = True,
        readers: Readers | None = None,
    ):
        self.engine = engine
        self.journal = journal
        self.flush_interval = flush_interval
        self.observer = observer or WriterObserver()
        self.cache_records = cache_records
        self.batch_records = batch_records
        self.prepare = prepare
        self.quarantine = quarantine or Quarantine.beside(journal.directory, journal.max_bytes)
        self.hold_retry = hold_retry
        self.db_healthy = True
        self.dropped = 0
        # Decoded records of the active and sealed segments, so the happy path never
        # re-reads the disk; None for segments only on disk (recovered or evicted).
        self._active: list[CallRecord] = []
        self._cache: dict[Path, list[CallRecord] | None] = {
            p: None for p in journal.recovered()
        }
        self._failed: set[Path] = set(self._cache)
        # Segments a previous process left, until written: then one line says how many
        # records they held (after a SIGKILL, what it had answered but not yet stored).
        self._recovered: set[Path] = set(self._cache)
        self._replayed = 0
        self._wake = asyncio.Event()  # flush now: a full batch, or close
        self._work = asyncio.Event()  # something to write: the idle loop wakes
        self._flushing = asyncio.Lock()  # the background loop and drain/tests may both flush
        self._task: asyncio.Task | None = None
        self._closing = False
        self._pending_count = 0
        self._fresh = 0  # records submitted into the active segment (not ones held back)
        self._retry_at = 0.0  # when records held back are offered to prepare again
        self._held: set[str] = set()  # call ids of records prepare handed back, until written
        # Each conversation's last stored call: the next one stores only its new blocks.
        self.blocks = BlockCache()
        # search_index: whether calls are indexed for the viewer's search (--no-search-index);
        # readers: where each API's requests hold their messages (storage.conversation),
        # the composer's (the proxy's registry): without it bodies are stored whole.
        self._insert = functools.partial(insert_calls, cache=self.blocks,
                                         search_index=search_index, readers=readers)

    encode = staticmethod(_encode)  # the journal's record format

    @property
    def held(self) -> int:
        """Records journaled and waiting until ``prepare`` can complete them (part of
        ``pending``)."""
        return len(self._held)

    @property
    def replayed(self) -> bool:
        """Whether the segments a previous process left are all written."""
        return not self._recovered

    @property
    def pending(self) -> int:
        """Records accepted but not yet committed (this process's view)."""
        return self._pending_count

    def submit(self, record: CallRecord, request_utf8: bytes | None = None) -> bool:
        """Journal a finished record; False (and counted) if the journal is full.
        ``request_utf8``: ``record.request`` as UTF-8, when the caller holds those bytes
        (written as they are: storage.journal_record.pieces)."""
        record, payload = self._journalable(record, request_utf8)
        if not self.journal.append(payload):
            self.dropped += 1
            self.observer.records("dropped", 1)
            log.error(
                "JOURNAL FULL (%d bytes): call %s of episode %s DROPPED; raise "
                "--journal-max-bytes or bring the database back",
                self.journal.bytes,
                record.call_id,
                record.episode_id,
            )
            self._tombstone(record)
            return False
        self._accepted(record)
        return True

    def _accepted(self, record: CallRecord) -> None:
        self._active.append(record)
        self._pending_count += 1
        self._fresh += 1
        self._work.set()
        if self.journal.active_full:
            self._seal()
        # A transaction per record would cost more CPU than the request itself: wake the
        # writer for a full batch, otherwise its flush interval collects what came.
        if len(self._active) >= self.batch_records:
            self._wake.set()

    def _tombstone(self, record: CallRecord) -> None:
        """A dropped record's episode still shows the call (storage.tombstones): its
        tombstone is journaled in the slack kept for them, if there is room."""
        if record.episode_id is None:
            return
        stone = tombstone(record, DROPPED, "journal full: the record was dropped")
        if self.journal.append(_encode(stone), slack=slack(self.journal.max_bytes)):
            self._accepted(stone)

    def _journalable(self, record: CallRecord, request_utf8: bytes | None = None,
                     ) -> tuple[CallRecord, bytes | list[bytes]]:
        """The record and its journal encoding (in pieces: storage.journal_record); a
        value msgpack cannot hold (an int over 64 bits, a lone surrogate) is replaced and
        the record says so (storage.storable)."""
        try:
            return record, _pieces(record, request_utf8)
        except (ValueError, TypeError, OverflowError) as exc:
            fixed, notes = storable(record, "journal")
            log.warning("call %s of episode %s cannot be journaled as captured (%s): %s",
                        record.call_id, record.episode_id, exc, "; ".join(notes))
            payload = _encode(fixed)  # what still fails is counted dropped by the caller
            self.observer.records("altered", 1)
            return fixed, payload

    def start(self) -> None:
        blocks.codec()  # the block codec (pyarrow) loaded now, not inside the first write
        if self._recovered:
            log.info("journal: %d segments (%d bytes) left by the previous process; "
                     "writing them to the database", len(self._recovered),
                     self.journal.recovered_bytes)
        self._task = asyncio.create_task(self._run(), name="tracetap-writer")

    async def close(self, timeout: float = 30.0) -> None:
        """Flush what can be flushed within ``timeout``; the rest stays journaled."""
        # Let the loop finish its current batch: cancelling a database write midway can
        # leave the driver's connection wedged, and the batch would be rewritten anyway.
        self._closing = True
        self._wake.set()
        self._work.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout)
            except asyncio.TimeoutError:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            await asyncio.wait_for(self.flush(), timeout)
        except (asyncio.TimeoutError, OSError, Exception) as exc:
            log.warning("writer closed with %d records still journaled: %s", self.pending, exc)
        self.journal.close()

    async def flush(self) -> None:
        """Write everything journaled so far; raises if the database refuses."""
        async with self._flushing:
            # Records only held back wait for their retry time rather than churn the disk.
            if self._fresh or self._closing or time.monotonic() >= self._retry_at:
                self._seal()
            for segment in self.journal.pending():
                await self._write_segment(segment)

    async def _run(self) -> None:
        backoff = 0.2
        while not self._closing:
            await self._idle()
            try:
                await asyncio.wait_for(self._wake.wait(), self.flush_interval)
            except asyncio.TimeoutError:
                pass
            if self._closing:
                return
            self._wake.clear()
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.db_healthy:
                    log.error("database write failed, journaling until it is back: %s", exc)
                self.db_healthy = False
                try:  # back off, but wake at once for close()
                    await asyncio.wait_for(self._wake.wait(), backoff)
                except asyncio.TimeoutError:
                    pass
                backoff = min(backoff * 2, 5.0)
                continue
            if not self.db_healthy:
                log.warning("database is back; journal replayed")
            self.db_healthy = True
            backoff = 0.2

    async def _idle(self) -> None:
        """Sleep while nothing waits to be written: an idle proxy that woke every flush
        interval to find nothing spent more CPU on that than on anything else."""
        self._work.clear()
        if self._pending_count == 0 and not self.journal.pending() and not self._closing:
            await self._work.wait()

    def _seal(self) -> None:
        segment = self.journal.seal()
        if segment is None:
            return
        self._fresh = 0
        self._cache[segment] = self._active
        self._active = []
        cached = sum(len(r) for r in self._cache.values() if r)
        for path, records in self._cache.items():
            if cached <= self.cache_records:
                break
            if records:
                cached -= len(records)
                self._cache[path] = None

    async def _write_segment(self, segment: Path) -> None:
        records = self._cache.get(segment)
        if records is None:
            records = self._read(segment)
        read = len(records)
        held = await self._prepare(records, hold=True)
        if held:
            ids = {id(r) for r in held}
            records = [r for r in records if id(r) not in ids]
            self._held.update(r.call_id for r in held)
        started = time.perf_counter()
        try:
            outcome = await write_batch(self.engine, records, self._insert)
        except Exception:
            self.observer.db_error()
            if segment not in self._failed:
                self._failed.add(segment)
                self.observer.records("spilled", len(records))
            raise
        if records:
            self.observer.db_write(time.perf_counter() - started, len(records))
        self._quarantine(outcome)  # before the segment goes: the dead-letter keeps them
        await self._quarantined(outcome)
        if held:  # journaled again before their segment goes
            await self._hold(held)
        replayed = segment in self._failed
        # A tombstone is no captured record (its drop was counted): not counted again.
        self.observer.records("replayed" if replayed else "written",
                              len(records) - len(outcome.refused) - tombstones(records))
        self._failed.discard(segment)
        self._cache.pop(segment, None)
        self.journal.remove(segment)
        self._pending_count = max(0, self._pending_count - len(records))
        self._held.difference_update(r.call_id for r in records)
        self._replayed_from(segment, read)

    def _replayed_from(self, segment: Path, records: int) -> None:
        if segment not in self._recovered:
            return
        self._recovered.discard(segment)
        self._replayed += records
        if not self._recovered:
            log.info("journal: replayed %d records left by the previous process",
                     self._replayed)

    def _read(self, segment: Path) -> list[CallRecord]:
        before = self.quarantine.overflow
        records, new = self.quarantine.decoded(read_segment(segment), _decode,
                                               self.engine.dialect.name)
        if new:
            self.observer.records("quarantined", new)
        if self.quarantine.overflow > before:  # the dead-letter file is full: lost
            self.observer.records("dropped", self.quarantine.overflow - before)
        return records

    def _quarantine(self, outcome: Outcome) -> None:
        refused, altered, lost = self.quarantine.keep(outcome, self.engine.dialect.name)
        if refused:
            self.observer.records("quarantined", refused)
        if altered:
            self.observer.records("altered", altered)
        if lost:
            self.observer.records("dropped", lost)

    async def _quarantined(self, outcome: Outcome) -> None:
        """Tombstones of the refused records (storage.tombstones), so their episodes show
        them; one the database refuses too is left to the dead-letter file."""
        stones = [tombstone(r.record, QUARANTINED, f"refused by the database: {r.reason}")
                  for r in outcome.refused if r.record.episode_id is not None]
        if stones:
            again = await write_batch(self.engine, stones, self._insert)
            if again.refused:
                log.error("%d tombstones refused too (first: call %s: %s)", len(again.refused),
                          again.refused[0].record.call_id, again.refused[0].reason)

    async def _prepare(self, records: list[CallRecord], hold: bool) -> list[CallRecord]:
        """Run ``prepare``; the records it hands back (none if it fails)."""
        if self.prepare is None or not records:
            return []
        hold = hold and self.journal.bytes < self.journal.max_bytes // 2
        try:
            return list(await self.prepare(records, hold=hold) or ())
        except Exception:  # a record without its extras beats a record not written
            log.exception("preparing %d records failed; writing them as they are",
                          len(records))
            return []

    async def _hold(self, held: list[CallRecord]) -> None:
        """Journal records ``prepare`` handed back; what does not fit is written now."""
        self._retry_at = time.monotonic() + self.hold_retry
        now = []
        for record in held:
            if self.journal.append(_encode(record)):
                self._active.append(record)
            else:
                now.append(record)
        if self.journal.active_full:
            self._seal()
        if now:
            await self._prepare(now, hold=False)
            outcome = await write_batch(self.engine, now, self._insert)
            self._quarantine(outcome)
            await self._quarantined(outcome)
            self.observer.records("written", len(now) - len(outcome.refused))
            self._pending_count = max(0, self._pending_count - len(now))
            self._held.difference_update(r.call_id for r in now)
