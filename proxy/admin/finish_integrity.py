"""The integrity verdict counted when an episode is finished (/metrics).

``tracetap_episodes_integrity_total{integrity}`` and
``tracetap_episode_integrity_causes_total{cause}`` count each finish by the verdict its
stored calls give then (storage.integrity). This process's own records of the episode
are flushed first (for at most ``FLUSH_WAIT`` seconds), so its calls are counted; a call
still in another worker's journal at that moment is not. The verdict the export, viewer
and analysis read is always computed from the stored calls, so it has no such gap.
"""

from __future__ import annotations

import asyncio
import logging

from tracetap.storage.integrity import Verdict, verdicts_of

log = logging.getLogger("tracetap")

FLUSH_WAIT = 2.0


async def verdict_at_finish(state, episode_id: str) -> Verdict | None:
    """The episode's verdict from what is stored now; None when it cannot be read."""
    writer = state.writer
    if writer.db_healthy and writer.pending:
        flushing = asyncio.ensure_future(writer.flush())
        flushing.add_done_callback(_quiet)
        try:  # shielded: a database write cut midway can wedge the driver's connection
            await asyncio.wait_for(asyncio.shield(flushing), FLUSH_WAIT)
        except (asyncio.TimeoutError, Exception):  # the writer retries it itself
            pass
    try:
        return (await verdicts_of(state.engine, [episode_id]))[episode_id]
    except Exception as exc:  # a metric is never worth failing a finish
        log.warning("integrity of episode %s not counted: %s", episode_id, exc)
        return None


def _quiet(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a failed flush is the writer's to report
