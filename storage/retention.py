"""Deleting what an export proved written (``tracetap prune --exported``).

The caller hands over, per episode, the calls an export wrote for each finished_at it
exported (its ledger). An episode goes, whole, only when it is finished, its current
finished_at is one that was exported, and every call it has now was written with that
version. Otherwise it stays, counted by why: still running, finished again since (the
new result is not exported yet), or calls that arrived after the export. Calls without
an episode go when the export wrote them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import msgspec
from sqlalchemy import delete, exists, func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tracetap.storage.tables import Call, Choice, Episode

# Exported calls per episode, per finished_at it was exported with.
Proven = dict[str, dict[float | None, set[str]]]
_IN = 500  # ids per IN list: well under every backend's parameter limit


class PruneCounts(msgspec.Struct, kw_only=True):
    episodes: int = 0
    calls: int = 0
    choices: int = 0
    kept_running: int = 0  # not finished (exported by --no-finished-only)
    kept_refinished: int = 0  # finished again after the export
    kept_late_calls: int = 0  # calls stored after the export


async def prune(engine: AsyncEngine, proven: Proven, untagged: Iterable[str], counts: PruneCounts,
                *, dry_run: bool) -> None:
    """Prune one chunk (a few hundred episodes) in one transaction; add to ``counts``."""
    async with engine.begin() as conn:
        query = select(Episode.id, Episode.finished_at).where(Episode.id.in_(list(proven)))
        if conn.dialect.name == "postgresql":
            query = query.with_for_update()  # a finish now waits for this transaction
        episodes = (await conn.execute(query)).all()
        has: dict[str, set[str]] = defaultdict(set)
        for call_id, episode_id in (await conn.execute(
                select(Call.call_id, Call.episode_id)
                .where(Call.episode_id.in_([e for e, _ in episodes])))).all():
            has[episode_id].add(call_id)
        doomed_episodes, doomed_calls = [], []
        for episode_id, finished_at in episodes:
            exported = proven[episode_id].get(finished_at)
            if finished_at is None:
                counts.kept_running += 1
            elif exported is None:
                counts.kept_refinished += 1
            elif not has[episode_id] <= exported:
                counts.kept_late_calls += 1
            else:
                doomed_episodes.append(episode_id)
                doomed_calls += has[episode_id]
        for chunk in _chunks(list(untagged)):
            doomed_calls += (await conn.execute(select(Call.call_id).where(
                Call.call_id.in_(chunk), Call.episode_id.is_(None)))).scalars()
        counts.episodes += len(doomed_episodes)
        counts.calls += len(doomed_calls)
        for chunk in _chunks(doomed_calls):
            counts.choices += (await conn.execute(select(func.count()).select_from(Choice)
                                                  .where(Choice.call_id.in_(chunk)))).scalar()
        if not dry_run:
            await _delete(conn, doomed_episodes, doomed_calls)


async def _delete(conn: AsyncConnection, episodes: list[str], calls: list[str]) -> None:
    for chunk in _chunks(calls):
        await conn.execute(delete(Choice).where(Choice.call_id.in_(chunk)))
        await conn.execute(delete(Call).where(Call.call_id.in_(chunk)))
    for chunk in _chunks(episodes):
        # A call stored meanwhile (SQLite has no row lock) keeps its episode.
        await conn.execute(delete(Episode).where(
            Episode.id.in_(chunk), ~exists().where(Call.episode_id == Episode.id)))


def _chunks(items: list[str]) -> list[list[str]]:
    return [items[i:i + _IN] for i in range(0, len(items), _IN)]
