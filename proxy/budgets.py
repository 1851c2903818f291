"""Per-episode budgets: calls, tokens and wall time an agent may spend.

A runaway agent (a loop, or a policy that learned that more calls pay) must not burn
the cluster or flood storage. Usage is counted in this process, like arrival order: with
several replicas each enforces its own count, so set limits per replica accordingly.
"""

from __future__ import annotations

import time

import msgspec

from tracetap.proxy.errors import ProxyError

# Episodes whose usage is kept; beyond that the least recently used is dropped (it
# restarts at zero), so memory stays bounded on a proxy serving millions of episodes.
TRACKED_EPISODES = 100_000


class Budget(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    max_calls: int | None = None
    max_tokens: int | None = None  # prompt + completion, as the engine reports usage
    max_seconds: float | None = None  # from the episode's registration or first call

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"budget {name} must be positive")

    @property
    def empty(self) -> bool:
        return self.max_calls is None and self.max_tokens is None and self.max_seconds is None

    def over(self, defaults: Budget) -> Budget:
        """This budget, with unset limits taken from ``defaults``."""
        return Budget(**{f: getattr(self, f) if getattr(self, f) is not None
                         else getattr(defaults, f) for f in self.__struct_fields__})


class Usage:
    __slots__ = ("budget", "calls", "started", "tokens")

    def __init__(self, budget: Budget, started: float):
        self.budget = budget
        self.calls = 0
        self.tokens = 0
        self.started = started


class BudgetExceeded(ProxyError):
    def __init__(self, episode_id: str, limit: str, detail: str):
        super().__init__(403, f"episode {episode_id!r} is over its {limit} budget ({detail}); "
                         "no more model calls are accepted for it", "permission_error",
                         "episode_budget_exceeded")
        self.limit = limit


class Budgets:
    def __init__(self, defaults: Budget, clock=time.monotonic):
        self.defaults = defaults
        self._clock = clock
        self._usage: dict[str, Usage] = {}

    def set(self, episode_id: str, budget: Budget) -> None:
        """A budget given at registration; the wall clock starts now."""
        self._track(episode_id, Usage(budget.over(self.defaults), self._clock()))

    def admit(self, episode_id: str | None) -> None:
        """Count one call, or raise BudgetExceeded if the episode has spent a limit."""
        if episode_id is None:
            return
        usage = self._usage.pop(episode_id, None)
        if usage is None:
            if self.defaults.empty:
                return
            usage = Usage(self.defaults, self._clock())
        self._track(episode_id, usage)  # re-inserted last: the dict's order is recency
        budget = usage.budget
        if budget.max_calls is not None and usage.calls >= budget.max_calls:
            raise BudgetExceeded(episode_id, "calls", f"{usage.calls} of {budget.max_calls}")
        if budget.max_tokens is not None and usage.tokens >= budget.max_tokens:
            raise BudgetExceeded(episode_id, "tokens", f"{usage.tokens} of {budget.max_tokens}")
        elapsed = self._clock() - usage.started
        if budget.max_seconds is not None and elapsed >= budget.max_seconds:
            raise BudgetExceeded(episode_id, "seconds",
                                 f"{elapsed:.0f}s of {budget.max_seconds:g}s")
        usage.calls += 1

    def spend(self, episode_id: str | None, tokens: int) -> None:
        usage = self._usage.get(episode_id) if episode_id is not None else None
        if usage is not None:
            usage.tokens += tokens

    def _track(self, episode_id: str, usage: Usage) -> None:
        self._usage[episode_id] = usage
        if len(self._usage) > TRACKED_EPISODES:
            del self._usage[next(iter(self._usage))]
