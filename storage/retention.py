"""Deleting what an export proved written (``tracetap prune --exported``).

The caller hands over, per episode, the calls an export wrote for each finished_at it
exported (its ledger). An episode goes, whole, only when it is finished, its current
finished_at is one that was exported, and every call it has now was written with that
version. Otherwise it stays, counted by why: still running, finished again since (the
new result is not exported yet), or calls that arrived after the export. Calls without
an episode go when the export wrote them.

Blocks (storage.blocks) are shared by calls, across episodes too (a GRPO group's first
prompt, a system message every call resends), so deleting a call never deletes a block
directly: ``prune`` collects the blocks the deleted calls referenced, and ``sweep``, once
per run, deletes those that no remaining call references. The sweep holds the block
store's exclusive lock (storage.blockstore) while it reads every remaining call's
references, so a writer cannot reference a block in between; writers wait meanwhile.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import msgspec
from sqlalchemy import delete, exists, func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tracetap.storage.blocks import unpack_refs
from tracetap.storage.blockstore import begin_sweeping, mark_swept
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
    blocks: int = 0  # blocks no call referenced any more, swept


_REFS = (Call.prompt_refs, Call.request_refs, Call.upstream_request_refs, Call.response_refs)


async def prune(engine: AsyncEngine, proven: Proven, untagged: Iterable[str], counts: PruneCounts,
                *, dry_run: bool, unlinked: set[bytes] | None = None) -> None:
    """Prune one chunk (a few hundred episodes) in one transaction; add to ``counts``, and
    to ``unlinked`` the blocks the deleted calls referenced (for ``sweep``)."""
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
            if unlinked is not None:
                for chunk in _chunks(doomed_calls):
                    for row in await conn.execute(select(*_REFS).where(Call.call_id.in_(chunk))):
                        unlinked.update(_hashes(row))
            await _delete(conn, doomed_episodes, doomed_calls)


async def sweep(engine: AsyncEngine, unlinked: set[bytes], counts: PruneCounts) -> None:
    """Delete the ``unlinked`` blocks that no call references any more."""
    if not unlinked:
        return
    doomed = set(unlinked)
    query = ("SELECT prompt_refs, request_refs, upstream_request_refs, response_refs "
             "FROM calls")
    async with engine.connect() as conn:
        raw = (await conn.get_raw_connection()).driver_connection
        if engine.dialect.name == "postgresql":
            async with raw.transaction():
                await begin_sweeping(raw, "postgresql")
                async for row in raw.cursor(query, prefetch=500):
                    doomed.difference_update(_hashes(row))
                gone = sorted(doomed)
                for chunk in _chunks(gone):
                    await raw.execute("DELETE FROM blocks WHERE hash = ANY($1::bytea[])", chunk)
                if gone:
                    await mark_swept(raw, "postgresql")
        else:
            try:
                await begin_sweeping(raw, "sqlite")
                async with raw.execute(query) as cursor:
                    async for row in cursor:
                        doomed.difference_update(_hashes(row))
                gone = sorted(doomed)
                for chunk in _chunks(gone):
                    await raw.execute(f"DELETE FROM blocks WHERE hash IN "
                                      f"({', '.join('?' * len(chunk))})", chunk)
                if gone:
                    await mark_swept(raw, "sqlite")
                await raw.commit()
            except BaseException:
                await raw.rollback()
                raise
    counts.blocks += len(gone)


def _hashes(row) -> Iterable[bytes]:
    return (h for refs in row if refs is not None for h, _ in unpack_refs(refs))


async def _delete(conn: AsyncConnection, episodes: list[str], calls: list[str]) -> None:
    for chunk in _chunks(calls):
        await conn.execute(delete(Choice).where(Choice.call_id.in_(chunk)))
        await conn.execute(delete(Call).where(Call.call_id.in_(chunk)))
    for chunk in _chunks(episodes):
        # A call stored meanwhile (SQLite has no row lock) keeps its episode.
        await conn.execute(delete(Episode).where(
            Episode.id.in_(chunk), ~exists().where(Call.episode_id == Episode.id)))


def _chunks(items: list) -> list[list]:
    return [items[i:i + _IN] for i in range(0, len(items), _IN)]
