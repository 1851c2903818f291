"""Arrival order of calls within an episode, as this process sees it."""

from __future__ import annotations

from tracetap.proxy.episodes.recent import Recent

# Episodes whose arrival counter is kept. An episode idle long enough to be dropped
# restarts at 0, which orders nothing wrongly: arrival order is (t_start, instance, seq),
# and seq only separates calls that start in the same instant.
SEQ_EPISODES = 100_000


class Arrivals:
    def __init__(self, size: int = SEQ_EPISODES):
        self._seq: Recent[str | None, int] = Recent(size)

    def served(self, episode_id: str) -> bool:
        """Whether this process has seen calls tagged with the episode (recently)."""
        return episode_id in self._seq

    def next(self, episode_id: str | None) -> int:
        """The call's place in its episode, for this process (replicas add t_start)."""
        seq = self._seq.get(episode_id, 0)
        self._seq.put(episode_id, seq + 1)
        return seq
