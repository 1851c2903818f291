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
    from tracetap.proxy.apis.fields import RequestFields
    from tracetap.proxy.apis.routing import Routing
    from tracetap.proxy.episodes.arrivals import Arrivals
    from tracetap.proxy.episodes.budgets import Budgets
    from tracetap.proxy.episodes.model_map import ModelMap
    from tracetap.proxy.episodes.policy_models import PolicyModels
    from tracetap.proxy.episodes.repair import Repair
    from tracetap.proxy.episodes.tagging import Tagger
    from tracetap.proxy.http.failures import Failures
    from tracetap.proxy.overlays.runner import Overlays
    from tracetap.proxy.policy.controls import Controls
    from tracetap.proxy.policy.gate import Gate
    from tracetap.proxy.runtime.metrics import Metrics
    from tracetap.proxy.runtime.settings import Settings
    from tracetap.proxy.tokens.prompt_prefix import PromptPrefixes
    from tracetap.proxy.upstream.pool import Pool
    from tracetap.storage.conversation import Readers
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
    request_fields: RequestFields  # what of a request may reach the engine
    repair: Repair  # history repair, and its memory of replies
    prompt_prefixes: PromptPrefixes  # prompt ids decoded in their new tokens only
    metrics: Metrics
    intents: Intents | NoIntents  # each call's intent, stored before its answer ends
    routed_experts: bool  # --routed-experts: ask the engine for each token's MoE routing
    readers: Readers  # each wire API's conversation reader

    def submit(self, record: CallRecord, request_utf8: bytes | None = None) -> None:
        """Hand a finished record to storage (journal first); never raises.
        ``request_utf8``: the record's request as UTF-8, when the caller has it
        (proxy.call.record.request_utf8)."""


class CallFront(CallServices, Protocol):
    """What the driver of a call uses besides its services: the request's way in and out."""

    settings: Settings  # body limits, the upstream key, the overhead header
    tagger: Tagger  # which episode the request belongs to
    overlays: Overlays  # the episode's overlay session, if any
    policy_models: PolicyModels  # which models the episode's calls may use
    pool: Pool  # the upstream the request is sent to
    routing: Routing  # --translate auto's fallback when the upstream answers 404
    failures: Failures  # a bug: counted, logged, answered as an internal error
