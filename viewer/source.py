"""The viewer's database: one storage.scan.Reader, opened on first use.

The export's Reader (without request bodies: the token view needs ids only) gives the
viewer its own connection pool, apart from the proxy's writer and admin API, so a heavy
page never queues behind capture. Opened lazily, so a proxy whose database is down at
start still relays; each page then says why it cannot read. The search has a small engine
of its own besides (storage.search_pool), opened on its first use.
"""

from __future__ import annotations

import asyncio

from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.storage.scan import Reader
from tracetap.storage.search_pool import SearchBounds, search_engine


class Source:
    def __init__(self, url: str, search: SearchBounds | None = None):
        self.url = url
        self.search = search or SearchBounds()
        self._reader: Reader | None = None
        self._search: AsyncEngine | None = None
        self._lock = asyncio.Lock()

    async def reader(self) -> Reader:
        if self._reader is None:
            async with self._lock:
                if self._reader is None:
                    reader = Reader(self.url, with_bodies=False, with_calls=True)
                    self._reader = await reader.__aenter__()
        return self._reader

    async def engine(self) -> AsyncEngine:
        return (await self.reader()).engine

    async def search_engine(self) -> AsyncEngine:
        """The search's engine; the reader is opened first (it checks the schema)."""
        await self.reader()
        if self._search is None:
            self._search = search_engine(self.url, self.search)
        return self._search

    async def close(self) -> None:
        if self._search is not None:
            await self._search.dispose()
            self._search = None
        if self._reader is not None:
            await self._reader.__aexit__(None, None, None)
            self._reader = None
