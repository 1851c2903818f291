"""What one running proxy holds: its settings and the parts that serve a call.

One instance per app (under an AppKey), so there is no module-level mutable state. The
jobs live in their own objects: the admission gate (``proxy.gate``), the shared pause and
policy version (``proxy.controls``), arrival order (``proxy.arrivals``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.proxy.apis.messages.capture import MessagesApi
from tracetap.proxy.apis.responses.capture import ResponsesApi
from tracetap.proxy.arrivals import Arrivals
from tracetap.proxy.budgets import Budgets
from tracetap.proxy.controls import Controls
from tracetap.proxy.exposure import Exposure
from tracetap.proxy.failures import Failures
from tracetap.proxy.gate import Gate
from tracetap.proxy.ids import instance_id
from tracetap.proxy.metrics import Metrics
from tracetap.proxy.model_map import ModelMap
from tracetap.proxy.overlays.runner import Overlays
from tracetap.proxy.pool import Pool
from tracetap.proxy.prompt_prefix import PromptPrefixes
from tracetap.proxy.repair import Repair
from tracetap.proxy.routing import Routing
from tracetap.proxy.settings import Settings
from tracetap.proxy.tagging import Tagger
from tracetap.storage import queries
from tracetap.storage.records import CallRecord
from tracetap.storage.writer import Writer

log = logging.getLogger("tracetap")


class ProxyState:
    def __init__(self, settings: Settings, *, engine: AsyncEngine, writer: Writer,
                 pool: Pool, tagger: Tagger, metrics: Metrics, admin_token: str,
                 overlays: Mapping[str, Any] | None = None):
        self.settings = settings
        self.admin_token = admin_token
        self.exposure = Exposure(settings.allow_path)
        self.budgets = Budgets(settings.default_budget, engine)
        self.failures = Failures(None if metrics is None else metrics.internal_errors)
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
        self.arrivals = Arrivals()
        self.prompt_prefixes = PromptPrefixes()
        # Set once SIGTERM starts the drain: /readyz answers 503 so a load balancer stops
        # sending new calls while the in-flight ones finish.
        self.draining = False
        self.gate = Gate(settings.pause_timeout)
        self.controls = Controls(engine, self.gate, self.instance,
                                 on_pause=metrics.set_paused if metrics else lambda _: None)

    def submit(self, record: CallRecord) -> None:
        """Hand a finished record to storage; never raises into a request."""
        try:
            self.writer.submit(record)
        except Exception:
            self.metrics.records("dropped", 1)
            log.exception("could not journal call %s; DROPPED", record.call_id)
