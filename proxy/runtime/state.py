"""What one running proxy holds: its settings and the parts that serve a call.

One instance per app (under an AppKey), so there is no module-level mutable state. The
jobs live in their own objects: the admission gate (``proxy.policy.gate``), the shared
pause and policy version (``proxy.policy.controls``), arrival order
(``proxy.episodes.arrivals``). Every part is built by one function,
``proxy.server.compose.compose_state``; this class only holds them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.proxy.apis.fields import RequestFields
from tracetap.proxy.apis.routing import Routing
from tracetap.proxy.episodes.arrivals import Arrivals
from tracetap.proxy.episodes.budgets import Budgets
from tracetap.proxy.episodes.model_map import ModelMap
from tracetap.proxy.episodes.policy_models import PolicyModels
from tracetap.proxy.episodes.repair import Repair
from tracetap.proxy.episodes.tagging import Tagger
from tracetap.proxy.http.exposure import Exposure
from tracetap.proxy.http.failures import Failures
from tracetap.proxy.overlays.runner import Overlays
from tracetap.proxy.policy.controls import Controls
from tracetap.proxy.policy.gate import Gate
from tracetap.proxy.runtime.metrics import Metrics
from tracetap.proxy.runtime.settings import Settings
from tracetap.proxy.tokens.prompt_prefix import PromptPrefixes
from tracetap.proxy.tokens.resolve import TokenResolver
from tracetap.proxy.upstream.flavor import Flavor
from tracetap.proxy.upstream.pool import Pool
from tracetap.storage.conversation import Readers
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
    request_fields: RequestFields
    overlays: Overlays
    policy_models: PolicyModels
    routing: Routing
    instance: str
    upstream_kind: Flavor
    arrivals: Arrivals
    prompt_prefixes: PromptPrefixes
    gate: Gate
    controls: Controls
    readers: Readers  # each wire API's conversation reader (the lineage's hash reads it)
    # Set once SIGTERM starts the drain: /readyz answers 503 so a load balancer stops
    # sending new calls while the in-flight ones finish.
    draining: bool = False

    @property
    def routed_experts(self) -> bool:
        """--routed-experts: ask the engine for each token's MoE routing
        (proxy.call.routed_experts)."""
        return self.settings.routed_experts

    @property
    def flavor(self) -> str:
        """The upstream's kind now (detection may find it after the start)."""
        return self.upstream_kind.name

    def submit(self, record: CallRecord, request_utf8: bytes | None = None) -> None:
        """Hand a finished record to storage; never raises into a request."""
        try:
            self.writer.submit(record, request_utf8)
        except Exception:
            self.metrics.records("dropped", 1)
            log.exception("could not journal call %s; DROPPED", record.call_id)
