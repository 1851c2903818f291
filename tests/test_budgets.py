"""proxy/episodes/budgets.py on its own, against a real (SQLite) ledger: which limit refuses a call
and how, what a call holds and gives back, and what happens when the ledger is down.

The end-to-end promises (parallel calls through several proxies, Postgres, a runaway
agent) are in test_hostile_episodes.py and test_hostile_agent.py."""

from __future__ import annotations

import asyncio
import errno
import logging

import pytest
from helpers.loop import free_port
from sqlalchemy import event

from tracetap.migrations import upgrade
from tracetap.proxy.apis.registry import caps
from tracetap.proxy.episodes.budgets import (
    Budget,
    BudgetExceeded,
    BudgetHeld,
    Budgets,
    Reservation,
    reservation_size,
)
from tracetap.proxy.http.errors import ProxyError
from tracetap.storage import budget_ledger
from tracetap.storage.budget_ledger import Limits
from tracetap.storage.engine import create_engine


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def run(db: str, body, defaults: Budget | None = None, clock: Clock | None = None):
    """``body(budgets, engine)`` on a fresh ledger; settlements finished before it returns."""

    async def main():
        engine = create_engine(db)
        budgets = Budgets(defaults or Budget(), engine, clock=clock or Clock())
        try:
            return await body(budgets, engine)
        finally:
            await budgets.settled()
            await engine.dispose()

    return asyncio.run(main())


@pytest.fixture
def db(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'b.db'}"
    upgrade(url)
    return url


async def register(budgets: Budgets, engine, episode: str, budget: Budget | None, at=1000.0):
    limits = budgets.limits_for(budget)
    if limits is not None:
        await budget_ledger.open_budget(engine, episode, limits, at, registered=True)
    budgets.registered(episode, limits)


def test_a_budget_limit_must_be_positive_and_unset_ones_come_from_the_defaults():
    for bad in ({"max_calls": 0}, {"max_tokens": -1}, {"max_seconds": 0.0}):
        with pytest.raises(ValueError, match=f"budget {next(iter(bad))} must be positive"):
            Budget(**bad)
    assert Budget().empty and not Budget(max_seconds=1.5).empty
    assert not Budget(max_calls=1).empty and not Budget(max_tokens=1).empty
    merged = Budget(max_calls=3).over(Budget(max_calls=9, max_tokens=50))
    assert merged == Budget(max_calls=3, max_tokens=50)
    assert merged.limits() == Limits(3, 50, None)
    assert Budget(max_seconds=2.5).limits() == Limits(None, None, 2.5)


def size(payload, body_bytes, endpoint="chat.completions"):
    """The reservation of a request to ``endpoint``, its caps read by its API."""
    return reservation_size(caps(endpoint, payload), body_bytes)


def test_a_reservation_counts_every_choice_and_only_integer_caps():
    assert size({}, 7) == 4096 + 7
    assert size({"max_tokens": 10, "n": 3}, 0) == 30
    assert size({"max_tokens": 10, "n": 128}, 0) == 1280
    assert size({"max_tokens": 1, "n": 1}, 0) == 1  # the smallest cap and count
    for n in (0, -2, 129, "3", 2.0, None, True):  # not a count of choices: one
        assert size({"max_tokens": 10, "n": n}, 1) == 11, n
    for cap in (0, -5, True, 3.5):  # not a cap: the next key, then the default
        assert size({"max_completion_tokens": cap, "max_tokens": 20}, 0) == 20
        assert size({"max_output_tokens": cap}, 0, "responses") == 4096
    assert size({"max_output_tokens": 1, "max_tokens": 2}, 0) == 2
    # Each API reads its own cap, and only chat and completions generate ``n`` choices.
    assert size({"max_output_tokens": 7, "max_tokens": 2, "n": 3}, 0, "responses:chat") == 7
    assert size({"max_tokens": 5, "max_output_tokens": 9, "n": 3}, 0, "messages") == 5
    assert size({"max_tokens": 5, "max_completion_tokens": 9, "n": 2}, 0, "completions") == 10
    assert size({"max_tokens": 5}, 1, "a-new-api") == 4096 + 1  # no reader: the default


def test_limits_are_stored_only_for_a_registration_with_a_budget():
    async def body(budgets, engine):
        return budgets.limits_for(None), budgets.limits_for(Budget(max_calls=2))

    none, limits = run("sqlite://", body, defaults=Budget(max_tokens=100, max_seconds=9.0))
    assert none is None and limits == Limits(2, 100, 9.0)


def test_each_limit_refuses_with_its_own_name_and_count(db):
    clock = Clock()

    async def body(budgets, engine):
        await register(budgets, engine, "calls", Budget(max_calls=2))
        await register(budgets, engine, "tokens", Budget(max_tokens=10))
        await register(budgets, engine, "time", Budget(max_seconds=30))
        admitted = [await budgets.reserve("calls", 5, keyed=True) for _ in range(2)]
        refusals = {}
        with pytest.raises(BudgetExceeded) as refusals["calls"]:
            await budgets.reserve("calls", 5, keyed=True)
        budgets.settle(await budgets.reserve("tokens", 4, keyed=True), 10)
        await budgets.settled()
        with pytest.raises(BudgetExceeded) as refusals["tokens"]:
            await budgets.reserve("tokens", 1, keyed=True)
        assert await budgets.reserve("time", 1, keyed=True) == Reservation("time", 1)
        clock.now += 30
        with pytest.raises(BudgetExceeded) as refusals["time"]:
            await budgets.reserve("time", 1, keyed=True)
        return admitted, {k: v.value for k, v in refusals.items()}

    admitted, refusals = run(db, body, clock=clock)
    assert admitted == [Reservation("calls", 5)] * 2
    for name, error in refusals.items():
        assert (error.status, error.type, error.code) == (403, "permission_error",
                                                          "episode_budget_exceeded")
        assert error.message.startswith(f"episode {name!r} is over its ")
        assert error.message.endswith("); no more model calls are accepted for it")
    assert refusals["calls"].limit == "calls"
    assert "episode 'calls' is over its calls budget (2 of 2)" in refusals["calls"].message
    assert refusals["tokens"].limit == "tokens"
    assert "over its tokens budget (10 of 10)" in refusals["tokens"].message
    assert refusals["time"].limit == "seconds"
    assert "over its seconds budget (30s of 30s)" in refusals["time"].message


def test_tokens_held_by_calls_in_flight_refuse_with_retry_and_come_back_when_settled(db):
    async def body(budgets, engine):
        await register(budgets, engine, "e", Budget(max_tokens=100))
        first = await budgets.reserve("e", 100, keyed=True)
        with pytest.raises(BudgetHeld) as held:
            await budgets.reserve("e", 1, keyed=True)
        budgets.settle(first, 30)  # the call used 30 of the 100 it held
        again = await budgets.reserve("e", 50, keyed=True)  # waits for that settlement
        ledger = await budget_ledger.spent(engine, "e")
        return held.value, again, ledger

    held, again, ledger = run(db, body)
    assert (held.status, held.type, held.code) == (429, "rate_limit_error",
                                                   "episode_budget_reserved")
    assert held.headers == {"Retry-After": "1"} and held.limit == "tokens_reserved"
    assert held.message == ("episode 'e': the rest of its tokens budget is reserved by its "
                            "calls in flight (0 used and 100 reserved of 100); retry when "
                            "they end")
    assert again == Reservation("e", 50)
    assert (ledger.calls, ledger.tokens_used, ledger.tokens_reserved) == (2, 30, 50)


def test_extra_attempts_spend_without_releasing_and_nothing_is_written_for_none(db):
    async def body(budgets, engine):
        await register(budgets, engine, "e", Budget(max_tokens=1000))
        reservation = await budgets.reserve("e", 40, keyed=True)
        budgets.spend(reservation, 7)
        budgets.spend(reservation, 0)
        budgets.spend(None, 9)
        budgets.settle(None, 9)
        await budgets.settled()
        during = await budget_ledger.spent(engine, "e")
        budgets.settle(reservation, 12)
        await budgets.settled()
        return during, await budget_ledger.spent(engine, "e")

    during, after = run(db, body)
    assert (during.tokens_used, during.tokens_reserved) == (7, 40)
    assert (after.tokens_used, after.tokens_reserved) == (19, 0)


def test_a_default_budget_opens_on_the_first_call_and_applies_to_every_episode(db):
    clock = Clock(5000.0)

    async def body(budgets, engine):
        first = await budgets.reserve("never-registered", 3, keyed=False)
        second = await budgets.reserve("never-registered", 3, keyed=False)
        with pytest.raises(BudgetExceeded) as third:
            await budgets.reserve("never-registered", 3, keyed=False)
        return first, second, third.value, await budget_ledger.spent(engine, "never-registered")

    first, second, third, ledger = run(db, body, defaults=Budget(max_calls=2), clock=clock)
    assert first == second == Reservation("never-registered", 3)
    assert third.limit == "calls" and "(2 of 2)" in third.message
    assert ledger.limits == Limits(2, None, None) and ledger.started_at == 5000.0


def test_a_first_call_over_a_tiny_default_budget_is_refused_at_once(db):
    async def body(budgets, engine):
        await budget_ledger.open_budget(engine, "spent", Limits(max_tokens=5), 1000.0)
        await budget_ledger.settle(engine, "spent", 0, 5)
        with pytest.raises(BudgetExceeded) as refused:
            await budgets.reserve("spent", 1, keyed=False)
        return refused.value

    refused = run(db, body, defaults=Budget(max_tokens=5))
    assert refused.limit == "tokens" and "(5 of 5)" in refused.message


def test_without_defaults_only_a_keyed_call_of_an_episode_with_its_own_budget_is_counted(db):
    async def body(budgets, engine):
        await budget_ledger.open_budget(engine, "elsewhere", Limits(max_calls=1), 1000.0,
                                        registered=True)  # registered on another proxy
        unkeyed = await budgets.reserve("elsewhere", 1, keyed=False)
        keyed = await budgets.reserve("elsewhere", 1, keyed=True)
        with pytest.raises(BudgetExceeded):
            await budgets.reserve("elsewhere", 1, keyed=True)
        await register(budgets, engine, "free", None)
        free = [await budgets.reserve("free", 1, keyed=True) for _ in range(3)]
        return unkeyed, keyed, free

    unkeyed, keyed, free = run(db, body)
    assert unkeyed is None and keyed == Reservation("elsewhere", 1) and free == [None] * 3


def test_an_episode_without_a_budget_row_is_asked_once(db, monkeypatch):
    asked, real = [], budget_ledger.has_budget

    async def counting(engine, episode_id):
        asked.append(episode_id)
        return await real(engine, episode_id)

    monkeypatch.setattr(budget_ledger, "has_budget", counting)

    async def body(budgets, engine):
        return [await budgets.reserve("open", 1, keyed=True) for _ in range(3)]

    assert run(db, body) == [None] * 3
    assert asked == ["open"]


def test_a_ledger_that_cannot_be_reached_refuses_with_503_and_retry(tmp_path, caplog):
    missing = f"sqlite:///{tmp_path / 'never-migrated.db'}"  # no budget table: an outage

    async def body(budgets, engine):
        with pytest.raises(ProxyError) as down:
            await budgets.reserve("e", 1, keyed=False)
        budgets.settle(Reservation("e", 5), 2)  # logged, never raised into the call
        await budgets.settled()
        return down.value

    with caplog.at_level(logging.ERROR, logger="tracetap"):
        down = run(missing, body, defaults=Budget(max_calls=3))
    assert (down.status, down.type, down.code) == (503, "server_error", "budget_unavailable")
    assert down.headers == {"Retry-After": "5"}
    assert down.message.startswith("the episode's budget could not be checked: ")
    assert down.message == ("the episode's budget could not be checked: no such table: "
                            "episode_budgets")  # the driver's words, not SQLAlchemy's
    [record] = [r for r in caplog.records if "could not settle" in r.getMessage()]
    assert record.getMessage() == ("could not settle the budget of episode 'e' "
                                   "(5 reserved, 2 used)")
    assert record.exc_info is not None


def test_a_budget_row_gone_between_two_questions_refuses_by_calls():
    """Only a race reaches it (the row deleted between the refused reservation and the
    question why): the call is refused, not let through."""
    refusal = Budgets(Budget(), engine=None)._refusal("e", None)
    assert type(refusal) is BudgetExceeded and refusal.limit == "calls"
    assert refusal.message == ("episode 'e' is over its calls budget (its budget row is "
                               "gone); no more model calls are accepted for it")


def _disk_gone(engine) -> None:
    """Every use of ``engine``'s connections fails with a bare OSError, as a SQLite file
    on a storage that went away does (no SQLAlchemy wrapper, no ``orig``)."""

    @event.listens_for(engine.sync_engine, "checkout")
    def refuse(*_):
        raise OSError(errno.EIO, "Input/output error")


@pytest.mark.parametrize("defaults, keyed", [
    (Budget(max_calls=3), False),  # the reservation itself
    (Budget(), True),  # the question whether a keyed episode has a budget of its own
], ids=["reserve", "has-budget"])
def test_a_ledger_outage_raising_a_bare_oserror_is_a_503_with_retry(db, defaults, keyed):
    async def body(budgets, engine):
        _disk_gone(engine)
        with pytest.raises(ProxyError) as down:
            await budgets.reserve("e", 1, keyed=keyed)
        return down.value

    down = run(db, body, defaults=defaults)
    assert (down.status, down.type, down.code) == (503, "server_error", "budget_unavailable")
    assert down.headers == {"Retry-After": "5"}
    assert down.message == ("the episode's budget could not be checked: "
                            "[Errno 5] Input/output error")
    assert isinstance(down.__cause__, OSError) and not hasattr(down.__cause__, "orig")


def test_a_postgres_that_is_down_is_a_503_with_retry():
    """asyncpg's refused connection reaches the proxy as a bare ConnectionRefusedError."""
    closed = f"postgresql://postgres@127.0.0.1:{free_port()}/test"  # nothing listens

    async def body(budgets, engine):
        with pytest.raises(ProxyError) as down:
            await budgets.reserve("e", 1, keyed=False)
        return down.value

    down = run(closed, body, defaults=Budget(max_calls=3))
    assert (down.status, down.code, down.headers) == (503, "budget_unavailable",
                                                      {"Retry-After": "5"})
    assert isinstance(down.__cause__, ConnectionRefusedError)
    assert "Connect call failed" in down.message
