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

import contextlib
from collections import defaultdict
from collections.abc import Iterable

import msgspec
from sqlalchemy import delete, exists, func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tracetap.storage.blocks import unpack_refs
from tracetap.storage.blockstore import begin_sweeping, mark_swept
from tracetap.storage.conversation import Readers
from tracetap.storage.search_index import forget
from tracetap.storage.tables import Annotation, Call, CallIntent, Choice, Episode

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
    annotations: int = 0  # people's annotations of the pruned episodes


_CALL_REFS = (Call.prompt_refs, Call.request_refs, Call.upstream_request_refs,
              Call.response_refs)
_CHOICE_REFS = (Choice.text_refs, Choice.completion_ids_refs, Choice.completion_logprobs_refs)


class Unlinked(msgspec.Struct):
    """What a prune run unlinked from the blocks: the blocks its deleted calls referenced,
    and (a dry run deletes nothing) those calls."""

    blocks: set[bytes] = set()
    calls: set[str] = set()


async def prune(engine: AsyncEngine, proven: Proven, untagged: Iterable[str], counts: PruneCounts,
                *, dry_run: bool, unlinked: Unlinked | None = None,
                readers: Readers | None = None) -> None:
    """Prune one chunk (a few hundred episodes) in one transaction; add to ``counts``, and
    to ``unlinked`` the blocks the deleted calls referenced (for ``sweep``). ``readers``:
    the request shapes the writer was given (SQLite's search postings go by the text
    recomputed with them: storage.search_index.forget)."""
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
        for chunk in _chunks(doomed_episodes):
            counts.annotations += (await conn.execute(select(func.count()).select_from(
                Annotation).where(Annotation.episode_id.in_(chunk)))).scalar()
        counts.calls += len(doomed_calls)
        for chunk in _chunks(doomed_calls):
            counts.choices += (await conn.execute(select(func.count()).select_from(Choice)
                                                  .where(Choice.call_id.in_(chunk)))).scalar()
            if unlinked is not None:
                for refs in (select(*_CALL_REFS).where(Call.call_id.in_(chunk)),
                             select(*_CHOICE_REFS).where(Choice.call_id.in_(chunk))):
                    for row in await conn.execute(refs):
                        unlinked.blocks.update(_hashes(row))
                if dry_run:
                    unlinked.calls.update(chunk)
        if not dry_run:
            await _delete(conn, doomed_episodes, doomed_calls, readers)


_SCANS = ("SELECT call_id, prompt_refs, request_refs, upstream_request_refs, response_refs "
          "FROM calls",
          "SELECT call_id, text_refs, completion_ids_refs, completion_logprobs_refs FROM choices")


async def sweep(engine: AsyncEngine, unlinked: Unlinked, counts: PruneCounts, *,
                dry_run: bool) -> None:
    """Delete the ``unlinked`` blocks that no call references any more (a dry run counts
    them: those no call outside ``unlinked.calls`` references)."""
    if not unlinked.blocks:
        return
    doomed = set(unlinked.blocks)
    async with engine.connect() as conn:
        raw = (await conn.get_raw_connection()).driver_connection
        postgres = engine.dialect.name == "postgresql"
        try:
            async with raw.transaction() if postgres else contextlib.nullcontext():
                await begin_sweeping(raw, engine.dialect.name)
                for scan in _SCANS:
                    rows = raw.cursor(scan, prefetch=500) if postgres else _sqlite_rows(raw, scan)
                    async for row in rows:
                        if row[0] not in unlinked.calls:
                            doomed.difference_update(_hashes(row[1:]))
                if not dry_run:
                    await _delete_blocks(raw, postgres, sorted(doomed))
            if not postgres:
                await (raw.rollback() if dry_run else raw.commit())
        except BaseException:
            if not postgres:
                await raw.rollback()
            raise
    counts.blocks += len(doomed)


async def _sqlite_rows(raw, sql: str):
    async with raw.execute(sql) as cursor:
        async for row in cursor:
            yield row


async def _delete_blocks(raw, postgres: bool, gone: list[bytes]) -> None:
    for chunk in _chunks(gone):
        if postgres:
            await raw.execute("DELETE FROM blocks WHERE hash = ANY($1::bytea[])", chunk)
        else:
            await raw.execute(f"DELETE FROM blocks WHERE hash IN ({', '.join('?' * len(chunk))})",
                              chunk)
    if gone:  # writers forget the blocks they knew stored (storage.dedup.BlockCache)
        await mark_swept(raw, "postgresql" if postgres else "sqlite")


def _hashes(row) -> Iterable[bytes]:
    return (h for refs in row if refs is not None for h, _ in unpack_refs(refs))


async def _delete(conn: AsyncConnection, episodes: list[str], calls: list[str],
                  readers: Readers | None) -> None:
    for chunk in _chunks(calls):
        # The search index first: SQLite's postings go by the text recomputed from the
        # call and its choices (storage.search_index).
        await forget(conn, chunk, readers)
        await conn.execute(delete(Choice).where(Choice.call_id.in_(chunk)))
        await conn.execute(delete(Call).where(Call.call_id.in_(chunk)))
        # Their intents too: without its row an intent would read as a call not stored.
        await conn.execute(delete(CallIntent).where(CallIntent.call_id.in_(chunk)))
    for chunk in _chunks(episodes):
        # A call stored meanwhile (SQLite has no row lock) keeps its episode, and with it
        # its annotations; else they go with it, in this transaction.
        await conn.execute(delete(Annotation).where(
            Annotation.episode_id.in_(chunk),
            ~exists().where(Call.episode_id == Annotation.episode_id)))
        await conn.execute(delete(Episode).where(
            Episode.id.in_(chunk), ~exists().where(Call.episode_id == Episode.id)))


def _chunks(items: list) -> list[list]:
    return [items[i:i + _IN] for i in range(0, len(items), _IN)]
