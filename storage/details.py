"""One episode and one call as the trace viewer shows them: summaries of an episode's
calls, a call with its bodies, the conversation and top logprobs of a trajectory's calls.
Token arrays are only counted here; their contents come from storage.scan. Bodies and
texts come with their credentials hidden (storage.credentials): these are what it shows.
"""

from __future__ import annotations

from typing import Any

import msgspec
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.storage.blocks import refs_length
from tracetap.storage.credentials import mask_body, mask_text, mask_value
from tracetap.storage.inflate import TEXT, resolve
from tracetap.storage.tables import Call, Choice, Episode

COMPLETED = ("ok", "passthrough")  # call statuses that are not failures (with HTTP 200)


class CallSummary(msgspec.Struct, kw_only=True):
    call_id: str
    seq: int
    endpoint: str
    model: str | None
    policy_version: str | None
    stream: bool
    upstream: str | None
    status: str
    http_status: int
    error: str | None
    t_start: float
    t_first_byte: float | None
    t_end: float | None
    upstream_latency: float | None
    prompt_tokens: int | None
    completion_tokens: int | None

    @property
    def failed(self) -> bool:
        return self.http_status != 200 or self.status not in COMPLETED


class EpisodeInfo(msgspec.Struct, kw_only=True):
    id: str
    group_id: str | None
    task_id: str | None
    harness_name: str | None
    harness_config: Any
    metadata: Any
    registered: bool
    created_at: float
    finished_at: float | None
    reward: float | None
    rewards: Any
    outcome: str | None
    info: Any
    calls: list[CallSummary]


class StoredChoice(msgspec.Struct, kw_only=True):
    index: int
    finish_reason: str | None
    text: str | None
    completion_tokens: int | None  # ids stored for this choice, None: none
    logprobs: int | None
    token_source: str
    top_logprobs: Any


class StoredCall(msgspec.Struct, kw_only=True):
    summary: CallSummary
    episode_id: str | None
    instance: str
    request: str | None
    response: str | None
    prompt_ids: int | None  # how many prompt ids were stored
    stored_at: float
    translation_dropped: Any  # {field: count} translation left out, or None
    choices: list[StoredChoice]


def _loads(value: str | None) -> Any:
    if value is None:
        return None
    try:
        return msgspec.json.decode(value)
    except msgspec.DecodeError:
        return value  # shown as the text it is


_SUMMARY = (Call.call_id, Call.seq, Call.endpoint, Call.model, Call.policy_version,
            Call.stream, Call.upstream, Call.status, Call.http_status, Call.error,
            Call.t_start, Call.t_first_byte, Call.t_end, Call.upstream_latency,
            Call.prompt_tokens, Call.completion_tokens)


_NAMES = [c.key for c in _SUMMARY]  # read once: an ORM attribute's name costs a lookup


def _summary(row) -> CallSummary:
    return CallSummary(**{name: row._mapping[name] for name in _NAMES})


async def episode_info(engine: AsyncEngine, episode_id: str) -> EpisodeInfo | None:
    """One episode and a summary of each of its calls, in arrival order."""
    async with engine.connect() as conn:
        e = (await conn.execute(select(Episode).where(Episode.id == episode_id))).first()
        if e is None:
            return None
        calls = (await conn.execute(
            select(*_SUMMARY).where(Call.episode_id == episode_id)
            .order_by(Call.t_start, Call.instance, Call.seq))).all()
    m = e._mapping
    return EpisodeInfo(
        id=e.id, group_id=e.group_id, task_id=e.task_id, harness_name=e.harness_name,
        harness_config=mask_value(_loads(e.harness_config))[0],
        metadata=mask_value(_loads(m["metadata"]))[0],
        registered=bool(e.registered), created_at=e.created_at, finished_at=e.finished_at,
        reward=e.reward, rewards=_loads(e.rewards), outcome=e.outcome,
        info=mask_value(_loads(e.info))[0],
        calls=[_summary(c) for c in calls])


async def stored_call(engine: AsyncEngine, call_id: str) -> StoredCall | None:
    """One call as stored, bodies included; token arrays only counted."""
    async with engine.connect() as conn:
        row = (await conn.execute(
            select(*_SUMMARY, Call.episode_id, Call.instance, Call.request, Call.response,
                   func.length(Call.prompt_ids).label("prompt_bytes"), Call.stored_at,
                   Call.translation_dropped, Call.prompt_refs,
                   Call.request_refs, Call.response_refs)
            .where(Call.call_id == call_id))).first()
        if row is None:
            return None
        request, response = (await resolve(
            conn, [(row.request, row.response, row.request_refs, row.response_refs)],
            [(0, 2, TEXT), (1, 3, TEXT)], 2))[0]
        choices = (await conn.execute(
            select(Choice.choice_index, Choice.finish_reason, Choice.text,
                   func.length(Choice.completion_ids).label("ids_bytes"),
                   func.length(Choice.completion_logprobs).label("lp_bytes"),
                   Choice.token_source, Choice.top_logprobs, Choice.text_refs,
                   Choice.completion_ids_refs, Choice.completion_logprobs_refs)
            .where(Choice.call_id == call_id).order_by(Choice.choice_index))).all()
        texts = await resolve(conn, [(c.text, c.text_refs) for c in choices], [(0, 1, TEXT)], 1)
    return StoredCall(
        summary=_summary(row), episode_id=row.episode_id, instance=row.instance,
        request=mask_body(request), response=mask_body(response),
        prompt_ids=_count(row.prompt_bytes, 4, row.prompt_refs), stored_at=row.stored_at,
        translation_dropped=_loads(row.translation_dropped),
        choices=[StoredChoice(
            index=c.choice_index, finish_reason=c.finish_reason,
            text=text if text is None else mask_text(text),
            completion_tokens=_count(c.ids_bytes, 4, c.completion_ids_refs),
            logprobs=_count(c.lp_bytes, 8, c.completion_logprobs_refs),
            token_source=c.token_source, top_logprobs=_loads(c.top_logprobs))
            for c, (text,) in zip(choices, texts)])


def _count(inline_bytes: int | None, width: int, refs: bytes | None) -> int | None:
    """Values stored inline (``width`` bytes each) or referenced (counted from the
    references alone, no block read); None: none stored."""
    if refs is not None:
        return refs_length(refs)
    return None if inline_bytes is None else inline_bytes // width


async def call_bodies(engine: AsyncEngine, call_ids: list[str]) -> dict[str, tuple]:
    """(endpoint, request, response) of each call: the conversation as the harness sent it."""
    if not call_ids:
        return {}
    async with engine.connect() as conn:
        rows = (await conn.execute(
            select(Call.call_id, Call.endpoint, Call.request, Call.response,
                   Call.request_refs, Call.response_refs)
            .where(Call.call_id.in_(call_ids)))).all()
        rows = await resolve(conn, rows, [(2, 4, TEXT), (3, 5, TEXT)], 4)
    return {r[0]: (r[1], mask_body(r[2]), mask_body(r[3])) for r in rows}
async def top_logprobs(engine: AsyncEngine, call_ids: list[str]) -> dict[tuple[str, int], list]:
    """Per-token alternatives of these calls' choices, where the client asked for them."""
    if not call_ids:
        return {}
    async with engine.connect() as conn:
        rows = (await conn.execute(
            select(Choice.call_id, Choice.choice_index, Choice.top_logprobs)
            .where(Choice.call_id.in_(call_ids), Choice.top_logprobs.is_not(None)))).all()
    out = {}
    for r in rows:
        value = _loads(r.top_logprobs)
        if isinstance(value, list):
            out[(r.call_id, r.choice_index)] = value
    return out
