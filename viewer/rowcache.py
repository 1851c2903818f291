"""The merged rows of recently opened episodes, kept while their calls are unchanged.

Reading an episode for its rows is the viewer's costliest read (every call's token
arrays: 80 MB for 200 calls that grow to 200,000 tokens), so paging through its token
windows reuses the rows built on first open. An entry is valid while the episode's call
count and latest stored_at are what they were; the cache holds at most MAX_TOKENS tokens.
"""

from __future__ import annotations

from collections import OrderedDict

from tracetap.storage import changes
from tracetap.storage.scan import Reader
from tracetap.viewer.tokens import Row, episode_rows

MAX_TOKENS = 2_000_000  # about 50 MB of arrays


class RowCache:
    def __init__(self, max_tokens: int = MAX_TOKENS):
        self.max_tokens = max_tokens
        self.items: OrderedDict[str, tuple[tuple, list[Row], int]] = OrderedDict()
        self.tokens = 0

    async def rows(self, reader: Reader, episode_id: str) -> list[Row]:
        stamp = await changes.episode_stamp(reader.engine, episode_id)
        hit = self.items.get(episode_id)
        if hit is not None and hit[0] == stamp:
            self.items.move_to_end(episode_id)
            return hit[1]
        rows, _ = await episode_rows(reader, episode_id)
        size = sum(r.total for r in rows)
        self._drop(episode_id)
        if size <= self.max_tokens:
            self.items[episode_id] = (stamp, rows, size)
            self.tokens += size
            while self.tokens > self.max_tokens:
                self._drop(next(iter(self.items)))
        return rows

    def _drop(self, episode_id: str) -> None:
        entry = self.items.pop(episode_id, None)
        if entry is not None:
            self.tokens -= entry[2]
