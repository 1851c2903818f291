"""What one running proxy holds: its settings and the parts that serve a call.

One instance per app (under an AppKey), so there is no module-level mutable state. The
jobs live in their own objects: the admission gate (``proxy.gate``), the shared pause and
policy version (``proxy.controls``), arrival order (``proxy.arrivals``). Every part is
built by one function, ``proxy.compose.compose_state``; this class only holds them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.proxy.arrivals import Arrivals
from tracetap.proxy.budgets import Budgets
from tracetap.proxy.controls import Controls
from tracetap.proxy.exposure import Exposure
from tracetap.proxy.failures import Failures
from tracetap.proxy.flavor import Flavor
from tracetap.proxy.gate import Gate
from tracetap.proxy.metrics import Metrics
from tracetap.proxy.model_map import ModelMap
from tracetap.proxy.overlays.runner import Overlays
from tracetap.proxy.pool import Pool
from tracetap.proxy.prompt_prefix import PromptPrefixes
from tracetap.proxy.repair import Repair
from tracetap.proxy.resolve import TokenResolver
from tracetap.proxy.routing import Routing
from tracetap.proxy.settings import Settings
from tracetap.proxy.tagging import Tagger
from tracetap.storage.intents import Intents, NoIntents
from tracetap.storage.records import CallRecord
from tracetap.storage.writer import Writer

log = logging.getLogger("tracetap")


@dataclass(eq=False)
class ProxyState:
    settings: Settings
    admin_token: str
    engine: AsyncEngine
    writer: Writer
    intents: Intents | NoIntents  # each call known to the database before it is answered
    resolver: TokenResolver
    pool: Pool
    tagger: Tagger
    metrics: Metrics
    exposure: Exposure
    budgets: Budgets
    failures: Failures
    repair: Repair
    model_map: ModelMap
    overlays: Overlays
    routing: Routing
    instance: str
    upstream_kind: Flavor
    arrivals: Arrivals
    prompt_prefixes: PromptPrefixes
    gate: Gate
    controls: Controls
    # Set once SIGTERM starts the drain: /readyz answers 503 so a load balancer stops
    # sending new calls while the in-flight ones finish.
    draining: bool = False

    @property
    def routed_experts(self) -> bool:
        """--routed-experts: ask the engine for each token's MoE routing (proxy.experts)."""
        return self.settings.routed_experts

    @property
    def flavor(self) -> str:
        """The upstream's kind now (detection may find it after the start)."""
        return self.upstream_kind.name

    def submit(self, record: CallRecord) -> None:
        """Hand a finished record to storage; never raises into a request."""
        try:
            self.writer.submit(record)
        except Exception:
            self.metrics.records("dropped", 1)
            log.exception("could not journal call %s; DROPPED", record.call_id)
