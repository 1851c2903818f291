"""Bulk reads for analysis: one row per episode with its calls' totals, and call summaries.

A whole selection is a few queries (explicit ids bound as one parameter), never one per
episode: failed calls are counted through the small ix_calls_failed index, token and
latency totals summed in the database when asked for. No token arrays and no bodies are
read here; ``Reader.bodies`` fetches the few bodies a caller needs.
"""

from __future__ import annotations

import operator

import msgspec
from sqlalchemy import func, select, text

from tracetap.storage.scan import EpisodeFilter, Reader, among, episode_conditions, fetch
from tracetap.storage.tables import FAILED_SQL, Call, Episode


class EpisodeSummary(msgspec.Struct, kw_only=True, gc=False):
    id: str
    group_id: str | None = None
    task_id: str | None = None
    harness_name: str | None = None
    harness_config: str | None = None  # JSON text, as stored
    metadata: str | None = None  # JSON text
    created_at: float = 0.0
    finished_at: float | None = None
    reward: float | None = None
    rewards: str | None = None  # JSON text
    outcome: str | None = None
    info: str | None = None  # JSON text
    failed_calls: int = 0  # storage.tables.FAILED_SQL
    # With costs only:
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency: float = 0.0  # seconds: the sum of the calls' t_end - t_start
    # The longest call's prompt + completion: the trajectory's length (storage.browse's
    # context_tokens), where prompt_tokens + completion_tokens count a resent history again
    # at each call.
    context_tokens: int = 0


class CallSummary(msgspec.Struct, kw_only=True, gc=False):
    call_id: str
    episode_id: str
    seq: int
    instance: str
    t_start: float
    endpoint: str
    status: str
    http_status: int
    error: str | None = None
    policy_version: str | None = None
    failed: bool = False  # storage.tables.FAILED_SQL: an upstream error, a cut stream, a 4xx/5xx


_FAILED = text(FAILED_SQL)  # spelled as ix_calls_failed's condition, so that index serves it
_EPISODE_COLUMNS = (
    Episode.id,
    Episode.group_id,
    Episode.task_id,
    Episode.harness_name,
    Episode.harness_config,
    Episode.meta,
    Episode.created_at,
    Episode.finished_at,
    Episode.reward,
    Episode.rewards,
    Episode.outcome,
    Episode.info,
)
# Columns stored before the bodies: SQLite reads them without following a row's overflow
# pages, so listing the calls of thousands of episodes stays cheap.
_CALL_COLUMNS = (
    Call.call_id,
    Call.episode_id,
    Call.seq,
    Call.instance,
    Call.t_start,
    Call.endpoint,
    Call.policy_version,
)


async def episode_summaries(
    reader: Reader, filt: EpisodeFilter, *, costs: bool = False
) -> list[EpisodeSummary]:
    """Every episode matching ``filt`` (``skip`` and ``finished_from`` apply), in id order,
    with its failed calls counted; ``costs`` also sums its calls' tokens and latency (a
    read of every call row: on SQLite, past the bodies)."""
    conditions = episode_conditions(filt)
    if filt.episode_ids:
        conditions.append(among(Episode.id, sorted(set(filt.episode_ids)), reader.engine))
    with reader.translated():
        async with reader.engine.connect() as conn:
            failed = dict(
                await fetch(
                    conn,
                    select(Call.episode_id, func.count()).where(_FAILED).group_by(Call.episode_id),
                )
            )
            query = select(*_EPISODE_COLUMNS).where(*conditions).order_by(Episode.id)
            out = [
                _summary(row, failed.get(row[0], 0))
                for row in await fetch(conn, query)
                if filt.skip.get(row[0], -1.0) != row[7]
            ]  # id, finished_at
            if costs and out:
                totals = (
                    select(
                        Call.episode_id,
                        func.count(),
                        func.sum(Call.prompt_tokens),
                        func.sum(Call.completion_tokens),
                        func.sum(Call.t_end - Call.t_start),
                        func.max(func.coalesce(Call.prompt_tokens, 0)
                                 + func.coalesce(Call.completion_tokens, 0)),
                    )
                    .where(Call.episode_id.in_(select(Episode.id).where(*conditions)))
                    .group_by(Call.episode_id)
                )
                by_id = {e.id: e for e in out}
                for episode_id, calls, prompt, completion, latency, longest in await fetch(
                        conn, totals):
                    if episode_id in by_id:
                        e = by_id[episode_id]
                        e.calls, e.prompt_tokens = int(calls), int(prompt or 0)
                        e.completion_tokens = int(completion or 0)
                        e.latency = float(latency or 0.0)
                        e.context_tokens = int(longest or 0)
    return out


async def call_summaries(reader: Reader, episode_ids: list[str]) -> list[CallSummary]:
    """The calls of these episodes, in arrival order (t_start, instance, seq); the status
    columns are read for the failed ones only (through ix_calls_failed)."""
    ids = sorted(set(episode_ids))
    with reader.translated():
        async with reader.engine.connect() as conn:
            rows = await fetch(
                conn, select(*_CALL_COLUMNS).where(among(Call.episode_id, ids, reader.engine))
            )
            # Every failed call at once: with an episode condition beside it, SQLite would
            # pick the episode index and read each row past its bodies to test the status.
            wanted = set(ids)
            failed = {
                call_id: (status, http_status, error)
                for call_id, episode_id, status, http_status, error in await fetch(
                    conn,
                    select(
                        Call.call_id, Call.episode_id, Call.status, Call.http_status, Call.error
                    ).where(_FAILED),
                )
                if episode_id in wanted
            }
    rows.sort(key=_ARRIVAL)
    calls = []
    for call_id, episode_id, seq, instance, t_start, endpoint, policy_version in rows:
        status, http_status, error = failed.get(call_id, _ANSWERED)
        calls.append(
            CallSummary(
                call_id=call_id,
                episode_id=episode_id,
                seq=seq,
                instance=instance,
                t_start=t_start,
                endpoint=endpoint,
                status=status,
                http_status=http_status,
                error=error,
                policy_version=policy_version,
                failed=call_id in failed,
            )
        )
    return calls


_ARRIVAL = operator.itemgetter(1, 4, 3, 2)  # episode_id, t_start, instance, seq
_ANSWERED = ("ok", 200, None)  # status, http_status, error of a call not in ix_calls_failed


def _summary(row, failed: int) -> EpisodeSummary:
    (
        id_,
        group_id,
        task_id,
        harness_name,
        harness_config,
        metadata,
        created_at,
        finished_at,
        reward,
        rewards,
        outcome,
        info,
    ) = row
    return EpisodeSummary(
        id=id_,
        group_id=group_id,
        task_id=task_id,
        harness_name=harness_name,
        harness_config=harness_config,
        metadata=metadata,
        created_at=created_at,
        finished_at=finished_at,
        reward=reward,
        rewards=rewards,
        outcome=outcome,
        info=info,
        failed_calls=int(failed),
    )


async def call_overlays(reader: Reader, call_ids: list[str]) -> dict[str, str]:
    """The overlay record (JSON text, ``calls.overlay``) of each of these calls that has
    one: what an overlay did to the call (docs/overlays.md, "What is recorded")."""
    if not call_ids:
        return {}
    with reader.translated():
        async with reader.engine.connect() as conn:
            rows = await fetch(
                conn,
                select(Call.call_id, Call.overlay).where(
                    among(Call.call_id, sorted(set(call_ids)), reader.engine),
                    Call.overlay.is_not(None),
                ),
            )
    return {call_id: text for call_id, text in rows}
