"""Sub-agent episodes (registered with ``parent``): the first call of each parent episode.

An episode's first call (in arrival order: t_start, instance, seq) always begins its
root lineage, whose id is that call's id (exporters.lineages); a sub-agent episode's root
lineages name it as their parent.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.storage.fetch import among, fetch
from tracetap.storage.tables import Call


async def first_calls(engine: AsyncEngine, episode_ids: list[str]) -> dict[str, str]:
    """Episode id → the id of its first call, for those of ``episode_ids`` with calls."""
    if not episode_ids:
        return {}
    query = select(Call.episode_id, Call.t_start, Call.instance, Call.seq, Call.call_id).where(
        among(Call.episode_id, sorted(set(episode_ids)), engine))
    async with engine.connect() as conn:
        rows = sorted(await fetch(conn, query), key=lambda r: (r[0], r[1], r[2], r[3]))
    first: dict[str, str] = {}
    for episode_id, _, _, _, call_id in rows:
        first.setdefault(episode_id, call_id)
    return first
