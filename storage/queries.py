"""Reads and admin writes: episodes and their calls. Not on the model-call path."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.storage.budget_ledger import Limits, open_budget
from tracetap.storage.codec import unpack_ids, unpack_logprobs
from tracetap.storage.dedup import BODIES
from tracetap.storage.engine import one_statement
from tracetap.storage.inflate import IDS, TEXT, resolve
from tracetap.storage.notify import EPISODES, FINISHED, send
from tracetap.storage.rows import insert_ignoring_duplicates
from tracetap.storage.tables import Call, Choice, Episode

_json = msgspec.json.encode


class EpisodeExists(Exception):
    pass


class EpisodeHasCalls(EpisodeExists):
    """Calls were stored under the id before anyone registered it: whoever sent them (a
    guessed id) must not have them adopted by the registration."""


def _dumps(value: Any) -> str | None:
    return None if value is None else _json(value).decode()


def _loads(value: str | None) -> Any:
    return None if value is None else msgspec.json.decode(value)


async def create_episode(
    engine: AsyncEngine,
    *,
    episode_id: str,
    key_hash: str,
    group_id: str | None,
    task_id: str | None,
    harness_name: str | None,
    harness_config: Any,
    metadata: Any,
    budget: Limits | None = None,
    parent_id: str | None = None,
) -> None:
    """Register an episode (with its budget row, in the same transaction). An id that
    already has stored calls is refused (EpisodeHasCalls): they were sent by whoever
    guessed the id, not by the holder of its key. ``parent_id``: the episode it is a
    sub-agent of (exporters.lineages)."""
    values = {
        Episode.group_id: group_id,
        Episode.task_id: task_id,
        Episode.harness_name: harness_name,
        Episode.harness_config: _dumps(harness_config),
        Episode.meta: _dumps(metadata),
        Episode.api_key_hash: key_hash,
        Episode.registered: True,
        Episode.registered_at: time.time(),
        Episode.parent_id: parent_id,
    }
    async with engine.begin() as conn:
        stmt = insert_ignoring_duplicates(engine.dialect.name, Episode.__table__)
        await conn.execute(stmt, [{"id": episode_id, "created_at": time.time(),
                                   "registered": False}])
        if (await conn.execute(select(Call.call_id).where(Call.episode_id == episode_id)
                               .limit(1))).first() is not None:
            raise EpisodeHasCalls(episode_id)
        result = await conn.execute(
            update(Episode)
            .where(Episode.id == episode_id, Episode.registered.is_(False))
            .values(values)
        )
        if result.rowcount != 1:
            raise EpisodeExists(episode_id)
        if budget is not None:
            await open_budget(conn, episode_id, budget, time.time(), registered=True)
        await send(conn, EPISODES)  # other processes learn of it at once (proxy.episodes.tagging)


class Finished(msgspec.Struct, frozen=True):
    """A finish as stored: ``changed`` False when it repeated the stored result (nothing
    was written); ``finish_seq`` counts the finishes that changed it (docs/export.md)."""

    changed: bool
    finish_seq: int


async def finish_episode(
    engine: AsyncEngine,
    episode_id: str,
    *,
    reward: float | None,
    rewards: dict[str, float] | None,
    outcome: str | None,
    info: Any,
    create_missing: bool = True,
) -> Finished | None:
    """Record the episode's result; None when the episode does not exist. A missing row
    is created unless ``create_missing`` is False (the admin API: a typo must not pass).
    Idempotent: the result it already has (a trainer's retried finish) changes nothing,
    so it is not exported again; another result is a new finish (``finish_seq`` + 1, a
    new finished_at: exported again, superseding the earlier rows)."""
    given = {"reward": reward, "rewards": rewards, "outcome": outcome, "info": info}
    async with engine.begin() as conn:
        if create_missing:
            stmt = insert_ignoring_duplicates(engine.dialect.name, Episode.__table__)
            await conn.execute(stmt, [{"id": episode_id, "created_at": time.time(),
                                       "registered": False}])
        row = (await conn.execute(
            select(Episode.finished_at, Episode.finish_seq, Episode.reward, Episode.rewards,
                   Episode.outcome, Episode.info)
            .where(Episode.id == episode_id).with_for_update())).first()
        if row is None:
            return None
        seq = row.finish_seq or (1 if row.finished_at is not None else 0)
        stored = {"reward": row.reward, "rewards": _loads(row.rewards),
                  "outcome": row.outcome, "info": _loads(row.info)}
        if row.finished_at is not None and stored == given:
            return Finished(changed=False, finish_seq=seq)
        await conn.execute(update(Episode).where(Episode.id == episode_id).values(
            finished_at=time.time(), finish_seq=seq + 1, reward=reward,
            rewards=_dumps(rewards), outcome=outcome, info=_dumps(info)))
        await send(conn, FINISHED)  # every process refuses its key at once (tagging)
        return Finished(changed=True, finish_seq=seq + 1)


def _episode_dict(row) -> dict[str, Any]:
    m = row._mapping
    return {
        "id": row.id,
        "group_id": row.group_id,
        "task_id": row.task_id,
        "harness": {"name": row.harness_name, "config": _loads(row.harness_config)}
        if row.harness_name or row.harness_config else None,
        "metadata": _loads(m["metadata"]),
        "registered": row.registered,
        "created_at": row.created_at,
        "finished_at": row.finished_at,
        "reward": row.reward,
        "rewards": _loads(row.rewards),
        "outcome": row.outcome,
        "info": _loads(row.info),
    }


async def episode_registration(engine: AsyncEngine, episode_id: str) -> dict[str, Any] | None:
    """One episode's row (no calls): what registration said about it."""
    async with engine.connect() as conn:
        row = (await conn.execute(select(Episode).where(Episode.id == episode_id))).first()
    return None if row is None else _episode_dict(row)


async def get_episode(engine: AsyncEngine, episode_id: str) -> dict[str, Any] | None:
    """One episode with a summary of each stored call, in arrival order."""
    async with engine.connect() as conn:
        row = (await conn.execute(select(Episode).where(Episode.id == episode_id))).first()
        if row is None:
            return None
        calls = (
            await conn.execute(
                select(Call.call_id, Call.seq, Call.endpoint, Call.model, Call.policy_version,
                       Call.stream, Call.status, Call.http_status, Call.t_start, Call.t_end,
                       Call.prompt_tokens, Call.completion_tokens)
                .where(Call.episode_id == episode_id)
                .order_by(Call.t_start, Call.seq)
            )
        ).all()
    episode = _episode_dict(row)
    episode["calls"] = [dict(c._mapping) for c in calls]
    # Marked by the call the proxy refused when the episode spent its budget.
    episode["budget_exceeded"] = any(c.status == "budget_exceeded" for c in calls)
    return episode


async def list_episodes(
    engine: AsyncEngine,
    *,
    limit: int,
    offset: int,
    group_id: str | None = None,
    finished: bool | None = None,
) -> dict[str, Any]:
    query = select(Episode)
    if group_id is not None:
        query = query.where(Episode.group_id == group_id)
    if finished is not None:
        query = query.where(
            Episode.finished_at.is_not(None) if finished else Episode.finished_at.is_(None)
        )
    async with engine.connect() as conn:
        total = (await conn.execute(select(func.count()).select_from(query.subquery()))).scalar()
        rows = (
            await conn.execute(query.order_by(Episode.created_at, Episode.id)
                               .limit(limit).offset(offset))
        ).all()
    return {"data": [_episode_dict(r) for r in rows], "total": total,
            "limit": limit, "offset": offset}


async def key_owner(engine: AsyncEngine, key_hash: str) -> str | None:
    async with engine.connect() as conn:
        return (
            await conn.execute(select(Episode.id).where(Episode.api_key_hash == key_hash))
        ).scalar()


async def is_registered(engine: AsyncEngine, episode_id: str) -> bool:
    async with engine.connect() as conn:
        return bool(
            (await conn.execute(select(Episode.registered).where(Episode.id == episode_id)))
            .scalar()
        )


async def is_finished(engine: AsyncEngine, episode_id: str) -> bool:
    async with engine.connect() as conn:
        return (await conn.execute(select(Episode.finished_at).where(
            Episode.id == episode_id))).scalar() is not None


async def finished_since(engine: AsyncEngine, since: float,
                         limit: int = 10_000) -> list[tuple[str, float]]:
    """Episodes finished at or after ``since`` (wall clock), oldest first."""
    return await _since(engine, Episode.finished_at, since, limit)


async def registered_since(engine: AsyncEngine, since: float,
                           limit: int = 10_000) -> list[tuple[str, float]]:
    """Episodes registered at or after ``since`` (wall clock), oldest first."""
    return await _since(engine, Episode.registered_at, since, limit)


async def _since(engine: AsyncEngine, column, since: float,
                 limit: int) -> list[tuple[str, float]]:
    async with one_statement(engine) as conn:  # polled by every process
        rows = await conn.execute(select(Episode.id, column).where(column >= since)
                                  .order_by(column).limit(limit))
        return [(r[0], r[1]) for r in rows]


async def calls_of(engine: AsyncEngine, episode_id: str | None) -> list[dict[str, Any]]:
    """Full stored calls of one episode (None: untagged calls), choices decoded."""
    async with engine.connect() as conn:
        condition = Call.episode_id.is_(None) if episode_id is None else (
            Call.episode_id == episode_id)
        calls = [dict(c._mapping) for c in (await conn.execute(
            select(Call).where(condition).order_by(Call.t_start, Call.seq))).all()]
        calls = await _inflated(conn, calls, _CALL_VALUES)
        ids = [c["call_id"] for c in calls]
        choices = [dict(c._mapping) for c in (
            await conn.execute(select(Choice).where(Choice.call_id.in_(ids))
                               .order_by(Choice.call_id, Choice.choice_index))
        ).all()] if ids else []
        choices = await _inflated(conn, choices, _CHOICE_VALUES)
    by_call: dict[str, list[dict[str, Any]]] = {}
    for ch in choices:
        by_call.setdefault(ch["call_id"], []).append({
            "index": ch["choice_index"],
            "finish_reason": ch["finish_reason"],
            "text": ch["text"],
            "completion_ids": unpack_ids(ch["completion_ids"]),
            "completion_logprobs": unpack_logprobs(ch["completion_logprobs"]),
            "top_logprobs": _loads(ch["top_logprobs"]),
            "token_source": ch["token_source"],
        })
    for row in calls:
        row["prompt_ids"] = unpack_ids(row["prompt_ids"])
        row["choices"] = by_call.get(row["call_id"], [])
    return calls


# Each value column and its references column.
_CALL_VALUES = [("prompt_ids", "prompt_refs", IDS),
                *((body, body + "_refs", TEXT) for body in BODIES)]
_CHOICE_VALUES = [("text", "text_refs", TEXT), ("completion_ids", "completion_ids_refs", IDS),
                  ("completion_logprobs", "completion_logprobs_refs", IDS)]


async def _inflated(conn, rows: list[dict], columns: list[tuple[str, str, str]]) -> list[dict]:
    """The rows with their values read back from their references (the references
    themselves left out)."""
    refs = [[r[name] for _, name, _ in columns] for r in rows]
    values = await resolve(conn, refs, [(i, i, kind) for i, (_, _, kind) in enumerate(columns)],
                           len(columns))
    for row, got in zip(rows, values):
        for (name, refs_name, _), value in zip(columns, got):
            if row.pop(refs_name) is not None:
                row[name] = value
    return rows

