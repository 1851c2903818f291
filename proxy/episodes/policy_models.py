"""Which served models an episode's calls may use: its policy models.

An upstream often serves more than the policy being trained (a judge, a reward model, a
bigger teacher). An agent that could name them would have their tokens trained as its
own, stamped with the policy's version. So an episode is bound to its policy models:
registration's ``policy_models``, else ``serve --policy-model`` (repeatable); none named
anywhere leaves every model allowed. The name checked is the one sent upstream, after
``--model-map``. A call to another model is refused (``--other-models refuse``, the
default: 403 ``model_not_allowed`` in the client's API shape, never sent upstream) or
served and stored apart (``store``: status ``other_model``, no policy version, left out
of trajectories like any call that is not ``ok``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from tracetap.proxy.episodes.recent import Recent
from tracetap.proxy.http.errors import ProxyError

OTHER_MODELS = ("refuse", "store")
OTHER_MODEL = "other_model"  # the stored status of a call served under ``store``
REMEMBERED = 100_000  # episodes whose policy models are kept (least recently used dropped)


def not_allowed(model: str | None) -> ProxyError:
    # The episode's own models are not named: the reply tells the agent nothing served.
    return ProxyError(403, f"model {model!r} is not a policy model of this episode",
                      "permission_error", "model_not_allowed")


def policy_models_of(metadata: Any) -> tuple[str, ...] | None:
    """Registration keeps the field in the episode's metadata (``"policy_models"``)."""
    found = metadata.get("policy_models") if isinstance(metadata, dict) else None
    return tuple(m for m in found if isinstance(m, str)) if isinstance(found, list) else None


class PolicyModels:
    def __init__(self, defaults: list[str] | tuple[str, ...], other_models: str,
                 registered: Callable[[str], Awaitable[dict[str, Any] | None]]):
        if other_models not in OTHER_MODELS:
            raise ValueError(f"--other-models must be one of {', '.join(OTHER_MODELS)}")
        self.defaults = tuple(defaults)
        self.store = other_models == "store"
        self._registered = registered  # the episode's registration row, from the database
        self._episodes: Recent[str, tuple[str, ...] | None] = Recent(REMEMBERED)

    def register(self, episode_id: str, models: list[str] | None) -> None:
        """An episode registered here: its models are known without asking."""
        self._episodes.put(episode_id, None if models is None else tuple(models))

    async def other(self, episode_id: str | None, model: str | None) -> bool:
        """Whether a call of ``episode_id`` sending ``model`` upstream is stored apart
        (True) or one of its policy models (False); refused (ProxyError) when it is not
        one and other models are refused."""
        allowed = await self._allowed(episode_id)
        if not allowed or model in allowed:
            return False
        if not self.store:
            raise not_allowed(model)
        return True

    async def _allowed(self, episode_id: str | None) -> tuple[str, ...]:
        if episode_id is None:
            return self.defaults
        if episode_id in self._episodes:
            own = self._episodes.get(episode_id)
        else:  # registered by another process, or before this one started
            try:
                row = await self._registered(episode_id)
            except Exception:  # the database cannot answer: the proxy's own list, unkept
                return self.defaults
            own = None if row is None else policy_models_of(row.get("metadata"))
            self._episodes.put(episode_id, own)
        return self.defaults if own is None else own
