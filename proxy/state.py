"""What one running proxy holds: its settings, peers and small in-memory state.

One instance per app (under an AppKey), so there is no module-level mutable state.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Mapping
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.proxy.apis.messages.capture import MessagesApi
from tracetap.proxy.apis.responses.capture import ResponsesApi
from tracetap.proxy.budgets import Budgets
from tracetap.proxy.errors import ProxyError
from tracetap.proxy.exposure import Exposure
from tracetap.proxy.ids import instance_id
from tracetap.proxy.metrics import Metrics
from tracetap.proxy.model_map import ModelMap
from tracetap.proxy.overlays.runner import Overlays
from tracetap.proxy.pool import Pool
from tracetap.proxy.repair import Repair
from tracetap.proxy.routing import Routing
from tracetap.proxy.settings import Settings
from tracetap.proxy.tagging import Tagger
from tracetap.storage import queries
from tracetap.storage.records import CallRecord
from tracetap.storage.writer import Writer

log = logging.getLogger("tracetap")

# Episodes whose arrival counter is kept; beyond that the least recently used is dropped,
# so a proxy serving millions of episodes does not keep one entry for each forever. An
# episode idle that long restarts at 0, which orders nothing wrongly: arrival order is
# (t_start, instance, seq), and seq only separates calls that start in the same instant.
SEQ_EPISODES = 100_000


class ProxyState:
    def __init__(self, settings: Settings, *, engine: AsyncEngine, writer: Writer,
                 pool: Pool, tagger: Tagger, metrics: Metrics, admin_token: str,
                 overlays: Mapping[str, Any] | None = None):
        self.settings = settings
        self.admin_token = admin_token
        self.exposure = Exposure(settings.allow_path)
        self.budgets = Budgets(settings.default_budget)
        self.repair = Repair(settings.repair_history,
                             None if metrics is None else metrics.repaired)
        self.model_map = ModelMap(settings.model_map)
        self.overlays = Overlays(overlays or {}, fail=settings.overlay_fail,
                                 timeout=settings.overlay_timeout,
                                 max_resamples=settings.overlay_max_resamples, metrics=metrics,
                                 registered=functools.partial(queries.episode_registration,
                                                              engine))
        self.routing = Routing(settings.translate, native={
            "responses": ResponsesApi(), "messages": MessagesApi()})
        self.engine = engine
        self.writer = writer
        self.pool = pool
        self.tagger = tagger
        self.metrics = metrics
        self.instance = instance_id()
        self.flavor = "openai" if settings.upstream_flavor == "auto" else settings.upstream_flavor
        self.policy_version: str | None = None
        self._seq: dict[str | None, int] = {}
        # Weight sync: while paused, new model calls wait; in-flight ones finish.
        self.running = asyncio.Event()
        self.running.set()
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        # Questions to an engine that cuts streams when asked anything (llama-cpp-python):
        # while one is out, new model calls wait for its answer.
        self._asking = 0
        self._not_asking = asyncio.Event()
        self._not_asking.set()

    async def admit(self) -> None:
        """Wait while paused (bounded), then count the call as in flight."""
        if not self.running.is_set():
            try:
                await asyncio.wait_for(self.running.wait(), self.settings.pause_timeout)
            except asyncio.TimeoutError:
                raise ProxyError(503, "the proxy is paused for a weight update; retry shortly",
                                 "server_error", "paused",
                                 headers={"Retry-After": "5"}) from None
        while self._asking:
            await self._not_asking.wait()
        self.inflight += 1  # no await since the check: no question can start in between
        self.idle.clear()

    @contextlib.asynccontextmanager
    async def quiet(self):
        """A window with no model call in flight; calls that arrive meanwhile wait."""
        while not self.idle.is_set():
            await self.idle.wait()
        self._asking += 1  # no await since the check: no call can be admitted in between
        self._not_asking.clear()
        try:
            yield
        finally:
            self._asking -= 1
            if not self._asking:
                self._not_asking.set()

    def release(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()

    def served(self, episode_id: str) -> bool:
        """Whether this process has seen calls tagged with the episode (recently)."""
        return episode_id in self._seq

    def next_seq(self, episode_id: str | None) -> int:
        """Arrival order within an episode, for this process (replicas add t_start)."""
        seq = self._seq.pop(episode_id, 0)
        self._seq[episode_id] = seq + 1  # re-inserted last: the dict's order is recency
        if len(self._seq) > SEQ_EPISODES:
            del self._seq[next(iter(self._seq))]
        return seq

    def submit(self, record: CallRecord) -> None:
        """Hand a finished record to storage; never raises into a request."""
        try:
            self.writer.submit(record)
        except Exception:
            self.metrics.records("dropped", 1)
            log.exception("could not journal call %s; DROPPED", record.call_id)
