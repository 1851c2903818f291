"""Episode budgets in the database: every process and replica reserves from one row.

Admission is one conditional UPDATE (``reserve``): the row is changed only when the
episode still has calls, time and unreserved tokens left, and both databases apply such a
statement atomically (Postgres re-checks the condition on the row it locked; SQLite runs
one writer at a time), so concurrent calls in any number of processes cannot all pass
the same check.
"""

from __future__ import annotations

import msgspec
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tracetap.storage.rows import dialect_insert, insert_ignoring_duplicates
from tracetap.storage.tables import EpisodeBudget

_B = EpisodeBudget


class Limits(msgspec.Struct, frozen=True):
    max_calls: int | None = None
    max_tokens: int | None = None
    max_seconds: float | None = None


class Spent(msgspec.Struct, frozen=True):
    """A budget row as it stands: its limits and what was spent and is held."""

    limits: Limits
    started_at: float
    calls: int
    tokens_used: int
    tokens_reserved: int


async def open_budget(conn: AsyncConnection | AsyncEngine, episode_id: str, limits: Limits,
                      started_at: float, *, registered: bool = False) -> None:
    """The episode's budget row. A default budget opened by a first call keeps the row
    another process opened first; a registration's budget replaces its limits (what the
    episode spent so far stays counted)."""
    if registered:
        stmt = dialect_insert(conn.dialect.name, _B.__table__)
        stmt = stmt.on_conflict_do_update(index_elements=["episode_id"], set_={
            **msgspec.structs.asdict(limits), "started_at": started_at})
    else:
        stmt = insert_ignoring_duplicates(conn.dialect.name, _B.__table__)
    row = {"episode_id": episode_id, "started_at": started_at, "calls": 0, "tokens_used": 0,
           "tokens_reserved": 0, **msgspec.structs.asdict(limits)}
    if isinstance(conn, AsyncEngine):
        async with conn.begin() as c:
            await c.execute(stmt, [row])
    else:
        await conn.execute(stmt, [row])


async def reserve(engine: AsyncEngine, episode_id: str, tokens: int, now: float) -> bool:
    """Count one call and hold ``tokens`` for it, if the episode has room: calls under
    their limit, time left, and tokens used plus held under theirs. False: no room, or no
    row (nothing was changed)."""
    stmt = (
        update(_B)
        .where(
            _B.episode_id == episode_id,
            (_B.max_calls.is_(None)) | (_B.calls < _B.max_calls),
            (_B.max_tokens.is_(None)) | (_B.tokens_used + _B.tokens_reserved < _B.max_tokens),
            (_B.max_seconds.is_(None)) | (_B.started_at + _B.max_seconds > now),
        )
        .values(calls=_B.calls + 1, tokens_reserved=_B.tokens_reserved + tokens)
    )
    async with engine.begin() as conn:
        return (await conn.execute(stmt)).rowcount == 1


async def settle(engine: AsyncEngine, episode_id: str, reserved: int, used: int) -> None:
    """A call ended: release what it held and count what it spent."""
    stmt = (
        update(_B)
        .where(_B.episode_id == episode_id)
        .values(tokens_reserved=_B.tokens_reserved - reserved, tokens_used=_B.tokens_used + used)
    )
    async with engine.begin() as conn:
        await conn.execute(stmt)


async def spent(engine: AsyncEngine, episode_id: str) -> Spent | None:
    async with engine.connect() as conn:
        row = (await conn.execute(select(_B).where(_B.episode_id == episode_id))).first()
    if row is None:
        return None
    return Spent(Limits(row.max_calls, row.max_tokens, row.max_seconds), row.started_at,
                 row.calls, row.tokens_used, row.tokens_reserved)


async def has_budget(engine: AsyncEngine, episode_id: str) -> bool:
    async with engine.connect() as conn:
        found = await conn.execute(select(_B.episode_id).where(_B.episode_id == episode_id))
        return found.first() is not None
