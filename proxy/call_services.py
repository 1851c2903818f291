"""What a model call may use of the running proxy, and nothing more.

``ModelCall`` is handed these services rather than the whole ``ProxyState`` (which
satisfies this protocol, as does a test's or a bench's namespace holding only the parts
its calls touch): no part of a call reaches the pool, the settings, the admin token or
the tagger. Its driver, ``ModelCall.run``, is given the front besides (``CallFront``,
which ``ProxyState`` satisfies too): the tagger, the body limits, the overlays and the
pool, for the steps that only the driver takes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tracetap.proxy.arrivals import Arrivals
    from tracetap.proxy.budgets import Budgets
    from tracetap.proxy.controls import Controls
    from tracetap.proxy.failures import Failures
    from tracetap.proxy.gate import Gate
    from tracetap.proxy.metrics import Metrics
    from tracetap.proxy.model_map import ModelMap
    from tracetap.proxy.overlays.runner import Overlays
    from tracetap.proxy.pool import Pool
    from tracetap.proxy.prompt_prefix import PromptPrefixes
    from tracetap.proxy.repair import Repair
    from tracetap.proxy.routing import Routing
    from tracetap.proxy.settings import Settings
    from tracetap.proxy.tagging import Tagger
    from tracetap.storage.intents import Intents, NoIntents
    from tracetap.storage.records import CallRecord


class CallServices(Protocol):
    flavor: str  # the upstream's flavor: what prepare asks for, how translation speaks
    instance: str  # this process, stamped on records
    arrivals: Arrivals  # arrival order per episode
    budgets: Budgets  # reserve, spend, settle
    gate: Gate  # the pause
    controls: Controls  # the policy version
    routing: Routing  # --translate auto's choice per request
    model_map: ModelMap
    repair: Repair  # history repair, and its memory of replies
    prompt_prefixes: PromptPrefixes  # prompt ids decoded in their new tokens only
    metrics: Metrics
    intents: Intents | NoIntents  # each call's intent, stored before its answer ends
    routed_experts: bool  # --routed-experts: ask the engine for each token's MoE routing

    def submit(self, record: CallRecord) -> None:
        """Hand a finished record to storage (journal first); never raises."""


class CallFront(CallServices, Protocol):
    """What the driver of a call uses besides its services: the request's way in and out."""

    settings: Settings  # body limits, the upstream key, the overhead header
    tagger: Tagger  # which episode the request belongs to
    overlays: Overlays  # the episode's overlay session, if any
    pool: Pool  # the upstream the request is sent to
    routing: Routing  # --translate auto's fallback when the upstream answers 404
    failures: Failures  # a bug: counted, logged, answered as an internal error
