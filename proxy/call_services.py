"""What a model call may use of the running proxy, and nothing more.

``ModelCall`` is handed these services rather than the whole ``ProxyState`` (which
satisfies this protocol, as does a test's or a bench's namespace holding only the parts
its calls touch): no call reaches the pool, the settings, the admin token or the tagger.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tracetap.proxy.arrivals import Arrivals
    from tracetap.proxy.budgets import Budgets
    from tracetap.proxy.controls import Controls
    from tracetap.proxy.gate import Gate
    from tracetap.proxy.metrics import Metrics
    from tracetap.proxy.model_map import ModelMap
    from tracetap.proxy.prompt_prefix import PromptPrefixes
    from tracetap.proxy.repair import Repair
    from tracetap.proxy.routing import Routing
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
    routed_experts: bool  # --routed-experts: ask the engine for each token's MoE routing

    def submit(self, record: CallRecord) -> None:
        """Hand a finished record to storage (journal first); never raises."""
