"""The incremental export's watermark (exporters/pipeline.py): the finished_at below which
every episode has been exported, trailing the newest exported episode by SETTLE_SECONDS,
and the episodes exported inside that window, remembered so they are never written twice.
It never passes an episode the run held back (exporters/settled.py: ``hold``, the
finished_at of the first held), so a later run still reads it.
"""

from __future__ import annotations

import heapq

SETTLE_SECONDS = 60.0


class Recent:
    """The watermark's overlap, kept small: exported episodes within SETTLE of the newest."""

    def __init__(self, watermark: float | None, recent: dict[str, float],
                 hold: float | None = None):
        self.floor = watermark
        self.hold = hold
        self.newest = max(recent.values(), default=watermark)
        self.items = dict(recent)
        self.heap = [(f, i) for i, f in recent.items()]
        heapq.heapify(self.heap)

    def add(self, episode_id: str, finished_at: float) -> None:
        self.items[episode_id] = finished_at
        heapq.heappush(self.heap, (finished_at, episode_id))
        if self.newest is None or finished_at > self.newest:
            self.newest = finished_at
        cutoff = self._cut(self.newest - SETTLE_SECONDS)
        while self.heap and self.heap[0][0] < cutoff:
            f, i = heapq.heappop(self.heap)
            if self.items.get(i) == f:
                del self.items[i]

    def result(self) -> tuple[float | None, dict[str, float]]:
        if self.newest is None:
            return self.floor, {}
        watermark = self._cut(self.newest - SETTLE_SECONDS)
        if self.floor is not None:
            watermark = max(watermark, self.floor)
        return watermark, {i: f for i, f in self.items.items() if f >= watermark}

    def _cut(self, watermark: float) -> float:
        """``watermark``, but not past the first held episode (exported ones from there on
        are remembered, so the next run does not write them again)."""
        return watermark if self.hold is None else min(watermark, self.hold)
