"""Write-behind writer: journal first, then batched idempotent inserts.

``submit`` is synchronous and never touches the database, so the request path only
pays for one journal append. A background task seals journal segments and writes
each in one transaction; a segment is deleted only after its commit. While the
database is down, segments accumulate on disk and are replayed when it returns.
An optional ``prepare`` step completes records just before they are written (the proxy
fills in token ids an engine did not return): off the request path, and it never fails
a write.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.storage.dedup import BlockCache
from tracetap.storage.journal import Journal, read_segment
from tracetap.storage.records import CallRecord
from tracetap.storage.rows import insert_calls

log = logging.getLogger("tracetap.writer")

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(CallRecord).decode


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
        prepare: Callable[[list[CallRecord]], Awaitable[None]] | None = None,
    ):
        self.engine = engine
        self.journal = journal
        self.flush_interval = flush_interval
        self.observer = observer or WriterObserver()
        self.cache_records = cache_records
        self.batch_records = batch_records
        self.prepare = prepare
        self.db_healthy = True
        self.dropped = 0
        # Decoded records of the active and sealed segments, so the happy path never
        # re-reads the disk; None for segments only on disk (recovered or evicted).
        self._active: list[CallRecord] = []
        self._cache: dict[Path, list[CallRecord] | None] = {
            p: None for p in journal.recovered()
        }
        self._failed: set[Path] = set(self._cache)
        self._wake = asyncio.Event()
        self._flushing = asyncio.Lock()  # the background loop and drain/tests may both flush
        self._task: asyncio.Task | None = None
        self._closing = False
        self._pending_count = 0
        # Each conversation's last stored call: the next one stores only its new blocks.
        self.blocks = BlockCache()

    encode = staticmethod(_encode)  # the journal's record format

    @property
    def pending(self) -> int:
        """Records accepted but not yet committed (this process's view)."""
        return self._pending_count

    def submit(self, record: CallRecord) -> bool:
        """Journal a finished record; False (and counted) if the journal is full."""
        if not self.journal.append(_encode(record)):
            self.dropped += 1
            self.observer.records("dropped", 1)
            log.error(
                "JOURNAL FULL (%d bytes): call %s of episode %s DROPPED; raise "
                "--journal-max-bytes or bring the database back",
                self.journal.bytes,
                record.call_id,
                record.episode_id,
            )
            return False
        self._active.append(record)
        self._pending_count += 1
        if self.journal.active_full:
            self._seal()
        # A transaction per record would cost more CPU than the request itself: wake the
        # writer for a full batch, otherwise its flush interval collects what came.
        if len(self._active) >= self.batch_records:
            self._wake.set()
        return True

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="tracetap-writer")

    async def close(self, timeout: float = 30.0) -> None:
        """Flush what can be flushed within ``timeout``; the rest stays journaled."""
        # Let the loop finish its current batch: cancelling a database write midway can
        # leave the driver's connection wedged, and the batch would be rewritten anyway.
        self._closing = True
        self._wake.set()
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
            self._seal()
            for segment in self.journal.pending():
                await self._write_segment(segment)

    async def _run(self) -> None:
        backoff = 0.2
        while not self._closing:
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

    def _seal(self) -> None:
        segment = self.journal.seal()
        if segment is None:
            return
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
            records = [_decode(payload) for payload in read_segment(segment)]
        if self.prepare is not None and records:
            try:
                await self.prepare(records)
            except Exception:  # a record without its extras beats a record not written
                log.exception("preparing %d records failed; writing them as they are",
                              len(records))
        started = time.perf_counter()
        try:
            if records:
                await insert_calls(self.engine, records, self.blocks)
        except Exception:
            self.observer.db_error()
            if segment not in self._failed:
                self._failed.add(segment)
                self.observer.records("spilled", len(records))
            raise
        self.observer.db_write(time.perf_counter() - started, len(records))
        replayed = segment in self._failed
        self.observer.records("replayed" if replayed else "written", len(records))
        self._failed.discard(segment)
        self._cache.pop(segment, None)
        self.journal.remove(segment)
        self._pending_count = max(0, self._pending_count - len(records))
