"""Episodes an export must leave for a later run: those whose calls are not all stored
yet (a replica's journal not written, storage.replicas), found once per run.

A held episode is left out of the page and out of the watermark's overlap, and the
watermark stays below the first one held (exporters/watermark.py), so the run after its
calls are stored exports it whole, once.
"""

from __future__ import annotations

import time

from tracetap.storage.replicas import Holds, holds, wait_settled
from tracetap.storage.scan import COLUMN, Reader, ScanPage


async def current_holds(reader: Reader) -> Holds:
    """The holds now; the live replicas are given a moment to renew their leases past
    the run's start (a finish committed just before it is then not held)."""
    with reader.translated():  # a database error reads as the scans' do
        await wait_settled(reader.engine, time.time())
        async with reader.engine.connect() as conn:
            return await holds(conn)


def without_held(page: ScanPage, found: Holds) -> tuple[ScanPage, set[str]]:
    """The page without its held episodes, and their ids."""
    held = {e.id for e in page.episodes if found.held(e.id, e.finished_at)}
    if not held:
        return page, held
    episode_id = COLUMN.episode_id
    return ScanPage([e for e in page.episodes if e.id not in held],
                    [r for r in page.rows if r[episode_id] not in held]), held
