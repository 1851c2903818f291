"""What one running proxy holds: its settings, peers and small in-memory state.

One instance per app (under an AppKey), so there is no module-level mutable state.
"""

from __future__ import annotations

import logging

from sqlalchemy.ext.asyncio import AsyncEngine

from proxy.ids import instance_id
from proxy.metrics import Metrics
from proxy.settings import Settings
from proxy.tagging import Tagger
from proxy.upstream import Upstream
from storage.records import CallRecord
from storage.writer import Writer

log = logging.getLogger("tracetap")


class ProxyState:
    def __init__(self, settings: Settings, *, engine: AsyncEngine, writer: Writer,
                 upstream: Upstream, tagger: Tagger, metrics: Metrics):
        self.settings = settings
        self.engine = engine
        self.writer = writer
        self.upstream = upstream
        self.tagger = tagger
        self.metrics = metrics
        self.instance = instance_id()
        self.flavor = "openai" if settings.upstream_flavor == "auto" else settings.upstream_flavor
        self.policy_version: str | None = None
        self._seq: dict[str | None, int] = {}

    def next_seq(self, episode_id: str | None) -> int:
        """Arrival order within an episode, for this process (replicas add t_start)."""
        seq = self._seq.get(episode_id, 0)
        self._seq[episode_id] = seq + 1
        return seq

    def submit(self, record: CallRecord) -> None:
        """Hand a finished record to storage; never raises into a request."""
        try:
            self.writer.submit(record)
        except Exception:
            self.metrics.records("dropped", 1)
            log.exception("could not journal call %s; DROPPED", record.call_id)
