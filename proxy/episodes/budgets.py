"""Per-episode budgets: calls, tokens and wall time an agent may spend.

A runaway agent (a loop, or a policy that learned that more calls pay) must not burn
the cluster or flood storage, and must not get around its budget by sending calls in
parallel or through several workers or replicas. A call is admitted by reserving its
tokens in the database (``storage.budget_ledger``: one conditional UPDATE shared by every
process) and settled when it ends, releasing what it did not use.

The rule: a call is admitted while the tokens used plus those held by calls in flight are
under the limit, and holds its completion cap plus its prompt's size in bytes (an upper
bound on its prompt tokens). So an episode spends at most its limit plus one call's
reservation, as long as each call stays within what it reserved (a call without a
completion cap reserves DEFAULT_COMPLETION_TOKENS). A call refused only because calls in
flight hold the rest gets 429 (retry), one refused because the budget is spent 403.

Only episodes with a budget touch the database: with no default budget, an episode
registered without one (or never registered) is admitted without asking it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.proxy.apis import Caps
from tracetap.proxy.apis.registry import caps
from tracetap.proxy.episodes.recent import Recent
from tracetap.proxy.http.errors import ProxyError
from tracetap.storage import budget_ledger
from tracetap.storage.budget_ledger import Limits

log = logging.getLogger("tracetap")

# What a call that states no completion cap (max_tokens and its kin) reserves.
DEFAULT_COMPLETION_TOKENS = 4096
# Episodes whose "has a budget of its own" answer is kept (least recently used dropped).
REMEMBERED = 100_000


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

    def limits(self) -> Limits:
        return Limits(self.max_calls, self.max_tokens, self.max_seconds)


class BudgetExceeded(ProxyError):
    def __init__(self, episode_id: str, limit: str, detail: str):
        super().__init__(403, f"episode {episode_id!r} is over its {limit} budget ({detail}); "
                         "no more model calls are accepted for it", "permission_error",
                         "episode_budget_exceeded")
        self.limit = limit


class BudgetHeld(BudgetExceeded):
    """The rest of the token budget is held by the episode's calls in flight: retry."""

    def __init__(self, episode_id: str, detail: str):
        ProxyError.__init__(self, 429, f"episode {episode_id!r}: the rest of its tokens budget "
                            f"is reserved by its calls in flight ({detail}); retry when they "
                            "end", "rate_limit_error", "episode_budget_reserved",
                            headers={"Retry-After": "1"})
        self.limit = "tokens_reserved"


class Reservation(msgspec.Struct):
    episode_id: str
    tokens: int
    completion: int = 0  # of ``tokens``, the completion cap's share


def reservation_size(caps: Caps, body_bytes: int) -> int:
    """Tokens a call holds: its completion cap (times its choices) plus its prompt's
    size in bytes (no tokenizer yields more tokens than bytes, and the JSON around the
    messages outweighs the chat template's tokens)."""
    return completion_cap(caps) + body_bytes


def completion_cap(caps: Caps) -> int:
    """The completion tokens a call may generate: its cap (or DEFAULT_COMPLETION_TOKENS)
    times its choices, as its API's ``caps`` read them (``apis.registry.caps``)."""
    return (caps.tokens or DEFAULT_COMPLETION_TOKENS) * caps.choices


def charged(capture, reservation: Reservation | None) -> int:
    """Tokens a call spent, to settle its reservation with: the engine's usage report,
    or, where a part of it is missing (a stream cut before its final usage chunk, by the
    agent or the upstream), what the engine was seen to process and generate: the prompt
    ids it returned and the completion tokens that went out (ids, else logprob entries,
    ``token_counts``). A completion of an API that reports neither is charged the whole
    completion cap it reserved: an agent cannot make its tokens free by cutting streams."""
    prompt, completion = capture.tokens()
    if prompt is None:
        packed = getattr(capture, "prompt_packed", None)  # no list of the prompt made
        ids = capture.prompt_ids if packed is None else None
        prompt = len(packed) // 4 if packed is not None else len(ids or ())
    if completion is None:
        counts = getattr(capture, "token_counts", None)
        if counts is not None:
            completion = sum(counts().values())
        else:
            completion = 0 if reservation is None else reservation.completion
    return prompt + completion


class Budgets:
    def __init__(self, defaults: Budget, engine: AsyncEngine, clock=time.time):
        self.defaults = defaults
        self._engine = engine
        self._clock = clock
        self._own: Recent[str, bool] = Recent(REMEMBERED)  # has a budget row of its own
        self._settling: dict[asyncio.Task, str] = {}  # settlements under way: episode

    def limits_for(self, budget: Budget | None) -> Limits | None:
        """The limits to store with a registration. None: no row of its own (default
        limits start with the episode's first call, as for ids never registered)."""
        return None if budget is None else budget.over(self.defaults).limits()

    def registered(self, episode_id: str, limits: Limits | None) -> None:
        """An episode registered here: whether it has a budget is known without asking."""
        self._own.put(episode_id, limits is not None)

    async def reserve_call(self, episode_id: str | None, endpoint: str,
                           payload: dict[str, Any], body_bytes: int, *,
                           keyed: bool) -> Reservation | None:
        """``reserve`` for a request to ``endpoint`` (its route's): its completion cap, as
        its API reads it, plus its prompt's bytes."""
        asked = caps(endpoint, payload)
        return await self.reserve(episode_id, reservation_size(asked, body_bytes),
                                  keyed=keyed, completion=completion_cap(asked))

    async def reserve(self, episode_id: str | None, tokens: int, *, keyed: bool,
                      completion: int = 0) -> Reservation | None:
        """Count one call and hold ``tokens`` for it, or raise BudgetExceeded. ``keyed``:
        the call carried the episode's key (only a registered episode can have a budget
        of its own). None: no budget applies."""
        if episode_id is None:
            return None
        try:
            # Inside the try: asking whether an episode has a budget of its own is a
            # ledger read too, and its outage must be the same 503 as the reservation's.
            if not await self._applies(episode_id, keyed):
                return None
            # The episode's earlier calls that ended here may still hold their
            # reservations: an agent's next call follows its last reply at once, and
            # must not be refused for tokens that call no longer holds.
            earlier = [task for task, episode in self._settling.items() if episode == episode_id]
            if earlier:
                await asyncio.gather(*earlier, return_exceptions=True)
            if not await budget_ledger.reserve(self._engine, episode_id, tokens, self._clock()):
                spent = await budget_ledger.spent(self._engine, episode_id)
                if spent is None:  # the episode's first call under the default budget
                    await budget_ledger.open_budget(self._engine, episode_id,
                                                    self.defaults.limits(), self._clock())
                    if not await budget_ledger.reserve(self._engine, episode_id, tokens,
                                                       self._clock()):
                        spent = await budget_ledger.spent(self._engine, episode_id)
                        raise self._refusal(episode_id, spent)
                else:
                    raise self._refusal(episode_id, spent)
        except (SQLAlchemyError, OSError) as exc:
            # SQLAlchemy's errors carry the driver's own words in ``orig``; a bare OSError
            # (asyncpg's refused connection, a disk gone) has none and is its own reason.
            reason = getattr(exc, "orig", None) or exc
            raise ProxyError(503, f"the episode's budget could not be checked: {reason}",
                             "server_error", "budget_unavailable",
                             headers={"Retry-After": "5"}) from exc
        return Reservation(episode_id, tokens, completion)

    def settle(self, reservation: Reservation | None, used: int) -> None:
        """The call ended having spent ``used`` tokens: release the rest (off the call)."""
        if reservation is not None:
            self._settle(reservation.episode_id, reservation.tokens, used)

    def spend(self, reservation: Reservation | None, used: int) -> None:
        """Tokens an extra attempt of a reserved call spent (overlay resamples)."""
        if reservation is not None and used:
            self._settle(reservation.episode_id, 0, used)

    async def settled(self) -> None:
        """Wait for settlements under way (shutdown, tests)."""
        while self._settling:
            await asyncio.gather(*list(self._settling), return_exceptions=True)

    async def _applies(self, episode_id: str, keyed: bool) -> bool:
        if not self.defaults.empty:
            return True
        if not keyed:
            return False
        own = self._own.get(episode_id)
        if own is None:
            own = await budget_ledger.has_budget(self._engine, episode_id)
            self._own.put(episode_id, own)
        return own

    def _settle(self, episode_id: str, reserved: int, used: int) -> None:
        task = asyncio.get_running_loop().create_task(self._store(episode_id, reserved, used))
        self._settling[task] = episode_id
        task.add_done_callback(self._settling.pop)

    async def _store(self, episode_id: str, reserved: int, used: int) -> None:
        try:
            await budget_ledger.settle(self._engine, episode_id, reserved, used)
        except (SQLAlchemyError, OSError):
            # Nothing to retry into: the episode keeps the reservation (it can only err
            # on the side of refusing), and the operator sees why.
            log.exception("could not settle the budget of episode %r (%d reserved, %d used)",
                          episode_id, reserved, used)

    def _refusal(self, episode_id: str, spent: budget_ledger.Spent | None) -> BudgetExceeded:
        if spent is None:
            return BudgetExceeded(episode_id, "calls", "its budget row is gone")
        limits = spent.limits
        if limits.max_calls is not None and spent.calls >= limits.max_calls:
            return BudgetExceeded(episode_id, "calls", f"{spent.calls} of {limits.max_calls}")
        elapsed = self._clock() - spent.started_at
        if limits.max_seconds is not None and elapsed >= limits.max_seconds:
            return BudgetExceeded(episode_id, "seconds",
                                  f"{elapsed:.0f}s of {limits.max_seconds:g}s")
        if limits.max_tokens is not None and spent.tokens_used >= limits.max_tokens:
            return BudgetExceeded(episode_id, "tokens",
                                  f"{spent.tokens_used} of {limits.max_tokens}")
        return BudgetHeld(episode_id, f"{spent.tokens_used} used and {spent.tokens_reserved} "
                          f"reserved of {limits.max_tokens}")
