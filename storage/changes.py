"""What is new in the database, for the viewer's live page and its caches: calls stored
and episodes created or finished since a time, the latest calls, an episode's stamp.
"""

from __future__ import annotations

import msgspec
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.storage.tables import Call, Episode


class LiveCall(msgspec.Struct, kw_only=True):
    call_id: str
    episode_id: str | None
    endpoint: str
    model: str | None
    status: str
    http_status: int
    t_start: float
    t_end: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    stored_at: float


class LiveEpisode(msgspec.Struct, kw_only=True):
    id: str
    group_id: str | None
    task_id: str | None
    created_at: float
    finished_at: float | None
    reward: float | None
    outcome: str | None


_LIVE_CALL = (Call.call_id, Call.episode_id, Call.endpoint, Call.model, Call.status,
              Call.http_status, Call.t_start, Call.t_end, Call.prompt_tokens,
              Call.completion_tokens, Call.stored_at)  # LiveCall's fields


async def calls_stored_since(engine: AsyncEngine, since: float, limit: int) -> list[LiveCall]:
    """Calls committed at or after ``since`` (the writer's stored_at), oldest first."""
    async with engine.connect() as conn:
        rows = (await conn.execute(
            select(*_LIVE_CALL)
            .where(Call.stored_at >= since).order_by(Call.stored_at, Call.call_id)
            .limit(limit))).all()
    return [LiveCall(**r._mapping) for r in rows]


async def episodes_changed_since(engine: AsyncEngine, since: float,
                                 limit: int) -> list[LiveEpisode]:
    """Episodes created or finished at or after ``since``."""
    columns = (Episode.id, Episode.group_id, Episode.task_id, Episode.created_at,
               Episode.finished_at, Episode.reward, Episode.outcome)
    async with engine.connect() as conn:
        created = (await conn.execute(
            select(*columns).where(Episode.created_at >= since)
            .order_by(Episode.created_at).limit(limit))).all()
        finished = (await conn.execute(
            select(*columns).where(Episode.finished_at >= since)
            .order_by(Episode.finished_at).limit(limit))).all()
    seen = {}
    for r in (*created, *finished):
        seen[r.id] = LiveEpisode(**r._mapping)
    return list(seen.values())


async def recent_calls(engine: AsyncEngine, limit: int) -> list[LiveCall]:
    """The latest stored calls, newest first (the live page's first rows)."""
    async with engine.connect() as conn:
        rows = (await conn.execute(
            select(*_LIVE_CALL)
            .order_by(Call.stored_at.desc(), Call.call_id.desc()).limit(limit))).all()
    return [LiveCall(**r._mapping) for r in rows]


async def episode_stamp(engine: AsyncEngine, episode_id: str) -> tuple[int, float | None]:
    """(calls, latest stored_at) of an episode: changes whenever a call is added."""
    async with engine.connect() as conn:
        row = (await conn.execute(
            select(func.count(), func.max(Call.stored_at))
            .where(Call.episode_id == episode_id))).one()
    return int(row[0]), row[1]
