"""Reading an export's next page of episodes while the current one is turned into rows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


async def prefetched(pages: AsyncIterator) -> AsyncIterator:
    """Read the next page while the current one is turned into rows."""
    iterator = pages.__aiter__()
    pending = asyncio.ensure_future(iterator.__anext__())
    try:
        while True:
            try:
                page = await pending
            except StopAsyncIteration:
                return
            pending = asyncio.ensure_future(iterator.__anext__())
            yield page
    finally:
        # Waited for, not cancelled: a cancelled read leaves its query running on the
        # database driver's thread (aiosqlite), which then reports to an event loop that
        # has closed ("Exception in thread ..." at exit, under the CLI's error line).
        await asyncio.gather(pending, return_exceptions=True)
        await iterator.aclose()
