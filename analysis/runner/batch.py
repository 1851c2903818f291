"""Every slot of a run, at most ``concurrency`` at a time, in order; stops at the first
error that is not an episode's own (the proxy unreachable, a harness that cannot start)."""

from __future__ import annotations

import asyncio
import time
from typing import TextIO

from tracetap.analysis.runner.admin import AdminClient
from tracetap.analysis.runner.episode import Commands, Result, run_slot
from tracetap.analysis.runner.plan import Slot
from tracetap.analysis.runner.progress import Progress


async def run_batch(
    slots: list[Slot],
    admin: AdminClient,
    commands: Commands,
    *,
    concurrency: int,
    progress_stream: TextIO,
) -> tuple[list[Result], float]:
    """The result of every slot, in the slots' order, and the seconds it took."""
    if concurrency < 1:
        raise ValueError("--concurrency must be at least 1")
    started = time.monotonic()
    progress = Progress(len(slots), progress_stream)
    results: list[Result | None] = [None] * len(slots)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(len(slots)):
        queue.put_nowait(index)

    async def worker() -> None:
        while not queue.empty():
            index = queue.get_nowait()
            progress.start()
            results[index] = result = await run_slot(slots[index], admin, commands)
            progress.finished(result)

    workers = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(slots)))]
    try:
        await asyncio.gather(*workers)
    finally:
        for task in workers:  # one failed: stop the others (their harnesses are killed)
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        progress.close()
    return [r for r in results if r is not None], time.monotonic() - started
