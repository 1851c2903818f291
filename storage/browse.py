"""Reads for the trace viewer: pages of episodes, one episode's calls, one call, what is new.

Not on the model-call path, and never a copy of the export's reads: token arrays and the
trajectory merge come from storage.scan and exporters.trajectories. Everything here is
small per request (a page of rows, one episode's call summaries), so that a database of
100,000 episodes answers as fast as one of ten.
"""

from __future__ import annotations

from typing import Any

import msgspec
from sqlalchemy import case, func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.storage.tables import FAILED_SQL, Call, Choice, Episode

SORTS = {
    "created": Episode.created_at,
    "finished": Episode.finished_at,
    "reward": Episode.reward,
    "id": Episode.id,
    "group": Episode.group_id,
    "task": Episode.task_id,
}
STATUSES = ("ok", "errors", "budget_exceeded")  # of an episode's calls
COMPLETED = ("ok", "passthrough")  # call statuses that are not failures (with HTTP 200)


class EpisodeQuery(msgspec.Struct, kw_only=True, frozen=True):
    """Which episodes, in which order, which page. Times are epoch seconds (created_at)."""

    search: str | None = None  # part of the episode id
    group_id: str | None = None
    task_id: str | None = None
    harness: str | None = None
    outcome: str | None = None
    status: str | None = None  # one of STATUSES
    finished: bool | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    since: float | None = None
    until: float | None = None
    sort: str = "created"
    descending: bool = True
    limit: int = 50
    offset: int = 0


class EpisodeRow(msgspec.Struct, kw_only=True):
    id: str
    group_id: str | None
    task_id: str | None
    harness_name: str | None
    created_at: float
    finished_at: float | None
    reward: float | None
    outcome: str | None
    calls: int = 0
    failed_calls: int = 0
    budget_exceeded: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_start: float | None = None
    last_end: float | None = None


class EpisodePage(msgspec.Struct, kw_only=True):
    rows: list[EpisodeRow]
    total: int
    query: EpisodeQuery


class GroupMember(msgspec.Struct, kw_only=True):
    id: str
    reward: float | None
    outcome: str | None
    finished_at: float | None


class GroupRow(msgspec.Struct, kw_only=True):
    group_id: str
    task_ids: list[str]
    members: list[GroupMember]
    latest: float

    @property
    def rewards(self) -> list[float]:
        return [m.reward for m in self.members if m.reward is not None]


class GroupPage(msgspec.Struct, kw_only=True):
    rows: list[GroupRow]
    total: int
    query: EpisodeQuery


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
    choices: list[StoredChoice]


class ChartSample(msgspec.Struct, kw_only=True):
    """The most recent episodes matching a query, for the episodes page's charts."""

    rewards: list[float]
    calls_per_episode: list[int]
    tokens_per_episode: list[int]
    # (t_start, duration, time to first byte or None) of their calls
    latencies: list[tuple[float, float, float | None]]
    episodes: int


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


# The partial index's own predicate, as literal SQL: the planner uses the index only when
# the query's condition is the same (bound parameters would not match it).
_FAILED = text(f"({FAILED_SQL})")


def _loads(value: str | None) -> Any:
    if value is None:
        return None
    try:
        return msgspec.json.decode(value)
    except msgspec.DecodeError:
        return value  # shown as the text it is


def _conditions(query: EpisodeQuery) -> list:
    conditions = []
    if query.search:
        escaped = query.search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        # Case-sensitive (ids are): LIKE scans a third faster than ILIKE on Postgres.
        conditions.append(Episode.id.like(f"%{escaped}%", escape="\\"))
    for column, value in ((Episode.group_id, query.group_id), (Episode.task_id, query.task_id),
                          (Episode.harness_name, query.harness),
                          (Episode.outcome, query.outcome)):
        if value is not None:
            conditions.append(column == value)
    if query.finished is not None:
        conditions.append(Episode.finished_at.is_not(None) if query.finished
                          else Episode.finished_at.is_(None))
    if query.reward_min is not None:
        conditions.append(Episode.reward >= query.reward_min)
    if query.reward_max is not None:
        conditions.append(Episode.reward <= query.reward_max)
    if query.since is not None:
        conditions.append(Episode.created_at >= query.since)
    if query.until is not None:
        conditions.append(Episode.created_at < query.until)
    if query.status is not None:
        # Served by the partial index of failed calls: failures are few.
        failed = select(Call.episode_id).where(_FAILED, Call.episode_id.is_not(None))
        if query.status == "errors":
            conditions.append(Episode.id.in_(failed))
        elif query.status == "budget_exceeded":
            conditions.append(Episode.id.in_(failed.where(Call.status == "budget_exceeded")))
        elif query.status == "ok":
            conditions.append(Episode.id.not_in(failed))
        else:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}")
    return conditions


def _order(query: EpisodeQuery, reverse: bool = False) -> list:
    """ORDER BY for the query's sort, or its exact reverse (nulls switch ends too)."""
    if query.sort not in SORTS:
        raise ValueError(f"sort must be one of {', '.join(SORTS)}")
    column = SORTS[query.sort]
    descending = query.descending != reverse
    key = column.desc() if descending else column.asc()
    tie = Episode.id.desc() if descending else Episode.id.asc()
    if column is Episode.id:
        return [key]
    if column is Episode.created_at:  # never null: plain, so its index serves the order
        return [key, tie]
    # Unfinished or unrewarded episodes last whichever the direction; id breaks ties so
    # that pages never overlap.
    return [key.nulls_first() if reverse else key.nulls_last(), tie]


async def episode_page(engine: AsyncEngine, query: EpisodeQuery) -> EpisodePage:
    """One page of matching episodes with their call counts, tokens and failures."""
    conditions = _conditions(query)
    columns = (Episode.id, Episode.group_id, Episode.task_id, Episode.harness_name,
               Episode.created_at, Episode.finished_at, Episode.reward, Episode.outcome)
    async with engine.connect() as conn:
        total = (await conn.execute(
            select(func.count()).select_from(Episode).where(*conditions))).scalar() or 0
        # A page past the middle is read from the other end: OFFSET walks every row it
        # skips, so the last page of 100,000 costs what the first does.
        backwards = query.offset > total // 2
        offset = max(0, total - query.offset - query.limit) if backwards else query.offset
        limit = min(query.limit, max(total - query.offset, 0)) if backwards else query.limit
        rows = (await conn.execute(
            select(*columns).where(*conditions).order_by(*_order(query, backwards))
            .limit(limit).offset(offset))).all()
        if backwards:
            rows.reverse()
        stats = await _call_stats(conn, [r.id for r in rows])
    out = []
    for r in rows:
        row = EpisodeRow(**r._mapping)
        stat = stats.get(r.id)
        if stat is not None:
            (row.calls, row.failed_calls, budget, row.prompt_tokens, row.completion_tokens,
             row.first_start, row.last_end) = stat
            row.budget_exceeded = bool(budget)
        out.append(row)
    return EpisodePage(rows=out, total=int(total), query=query)


async def _call_stats(conn, ids: list[str]) -> dict[str, tuple]:
    if not ids:
        return {}
    failed = func.sum(case((_FAILED, 1), else_=0))
    budget = func.sum(case((Call.status == "budget_exceeded", 1), else_=0))
    rows = (await conn.execute(
        select(Call.episode_id, func.count(), failed, budget,
               func.coalesce(func.sum(Call.prompt_tokens), 0),
               func.coalesce(func.sum(Call.completion_tokens), 0),
               func.min(Call.t_start), func.max(Call.t_end))
        .where(Call.episode_id.in_(ids)).group_by(Call.episode_id))).all()
    return {r[0]: (int(r[1]), int(r[2] or 0), int(r[3] or 0), int(r[4]), int(r[5]), r[6], r[7])
            for r in rows}


async def group_page(engine: AsyncEngine, query: EpisodeQuery) -> GroupPage:
    """Groups (GRPO) with a matching episode, newest first, each with all its members."""
    conditions = [*_conditions(query), Episode.group_id.is_not(None)]
    latest = func.max(Episode.created_at).label("latest")
    async with engine.connect() as conn:
        # COUNT over a GROUP BY hashes; COUNT(DISTINCT) sorts, at twice the time.
        total = (await conn.execute(select(func.count()).select_from(
            select(Episode.group_id).where(*conditions).group_by(Episode.group_id)
            .subquery()))).scalar()
        groups = (await conn.execute(
            select(Episode.group_id, latest).where(*conditions).group_by(Episode.group_id)
            .order_by(latest.desc(), Episode.group_id).limit(query.limit)
            .offset(query.offset))).all()
        ids = [g.group_id for g in groups]
        members = (await conn.execute(
            select(Episode.group_id, Episode.id, Episode.task_id, Episode.reward,
                   Episode.outcome, Episode.finished_at)
            .where(Episode.group_id.in_(ids)).order_by(Episode.group_id, Episode.id)
        )).all() if ids else []
    by_group: dict[str, GroupRow] = {
        g.group_id: GroupRow(group_id=g.group_id, task_ids=[], members=[], latest=g.latest)
        for g in groups}
    for m in members:
        row = by_group[m.group_id]
        row.members.append(GroupMember(id=m.id, reward=m.reward, outcome=m.outcome,
                                       finished_at=m.finished_at))
        if m.task_id is not None and m.task_id not in row.task_ids:
            row.task_ids.append(m.task_id)
    return GroupPage(rows=list(by_group.values()), total=int(total or 0), query=query)


async def chart_sample(engine: AsyncEngine, query: EpisodeQuery, limit: int) -> ChartSample:
    """The ``limit`` most recent matching episodes: rewards, calls, tokens, latencies."""
    conditions = _conditions(query)
    async with engine.connect() as conn:
        episodes = (await conn.execute(
            select(Episode.id, Episode.reward).where(*conditions)
            .order_by(Episode.created_at.desc(), Episode.id.desc()).limit(limit))).all()
        ids = [e.id for e in episodes]
        calls = (await conn.execute(
            select(Call.episode_id, Call.t_start, Call.t_first_byte, Call.t_end,
                   Call.prompt_tokens, Call.completion_tokens)
            .where(Call.episode_id.in_(ids)))).all() if ids else []
    per_episode: dict[str, list[int]] = {i: [0, 0] for i in ids}
    latencies = []
    for c in calls:
        counts = per_episode[c.episode_id]
        counts[0] += 1
        counts[1] += (c.prompt_tokens or 0) + (c.completion_tokens or 0)
        if c.t_end is not None:
            ttft = None if c.t_first_byte is None else c.t_first_byte - c.t_start
            latencies.append((c.t_start, c.t_end - c.t_start, ttft))
    return ChartSample(
        rewards=[e.reward for e in episodes if e.reward is not None],
        calls_per_episode=[v[0] for v in per_episode.values()],
        tokens_per_episode=[v[1] for v in per_episode.values()],
        latencies=sorted(latencies), episodes=len(ids))


_SUMMARY = (Call.call_id, Call.seq, Call.endpoint, Call.model, Call.policy_version,
            Call.stream, Call.upstream, Call.status, Call.http_status, Call.error,
            Call.t_start, Call.t_first_byte, Call.t_end, Call.upstream_latency,
            Call.prompt_tokens, Call.completion_tokens)


def _summary(row) -> CallSummary:
    return CallSummary(**{c.name: row._mapping[c.name] for c in _SUMMARY})


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
        harness_config=_loads(e.harness_config), metadata=_loads(m["metadata"]),
        registered=bool(e.registered), created_at=e.created_at, finished_at=e.finished_at,
        reward=e.reward, rewards=_loads(e.rewards), outcome=e.outcome, info=_loads(e.info),
        calls=[_summary(c) for c in calls])


async def group_rewards(engine: AsyncEngine, group_id: str) -> list[GroupMember]:
    async with engine.connect() as conn:
        rows = (await conn.execute(
            select(Episode.id, Episode.reward, Episode.outcome, Episode.finished_at)
            .where(Episode.group_id == group_id).order_by(Episode.id))).all()
    return [GroupMember(**r._mapping) for r in rows]


async def stored_call(engine: AsyncEngine, call_id: str) -> StoredCall | None:
    """One call as stored, bodies included; token arrays only counted."""
    ids_length = func.length(Call.prompt_ids)
    async with engine.connect() as conn:
        row = (await conn.execute(
            select(*_SUMMARY, Call.episode_id, Call.instance, Call.request, Call.response,
                   ids_length.label("prompt_bytes"), Call.stored_at)
            .where(Call.call_id == call_id))).first()
        if row is None:
            return None
        choices = (await conn.execute(
            select(Choice.choice_index, Choice.finish_reason, Choice.text,
                   func.length(Choice.completion_ids).label("ids_bytes"),
                   func.length(Choice.completion_logprobs).label("lp_bytes"),
                   Choice.token_source, Choice.top_logprobs)
            .where(Choice.call_id == call_id).order_by(Choice.choice_index))).all()
    return StoredCall(
        summary=_summary(row), episode_id=row.episode_id, instance=row.instance,
        request=row.request, response=row.response,
        prompt_ids=None if row.prompt_bytes is None else row.prompt_bytes // 4,
        stored_at=row.stored_at,
        choices=[StoredChoice(
            index=c.choice_index, finish_reason=c.finish_reason, text=c.text,
            completion_tokens=None if c.ids_bytes is None else c.ids_bytes // 4,
            logprobs=None if c.lp_bytes is None else c.lp_bytes // 8,
            token_source=c.token_source, top_logprobs=_loads(c.top_logprobs))
            for c in choices])


async def call_bodies(engine: AsyncEngine, call_ids: list[str]) -> dict[str, tuple]:
    """(endpoint, request, response) of each call: the conversation as the harness sent it."""
    if not call_ids:
        return {}
    async with engine.connect() as conn:
        rows = (await conn.execute(
            select(Call.call_id, Call.endpoint, Call.request, Call.response)
            .where(Call.call_id.in_(call_ids)))).all()
    return {r.call_id: (r.endpoint, r.request, r.response) for r in rows}


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


async def calls_stored_since(engine: AsyncEngine, since: float, limit: int) -> list[LiveCall]:
    """Calls committed at or after ``since`` (the writer's stored_at), oldest first."""
    async with engine.connect() as conn:
        rows = (await conn.execute(
            select(Call.call_id, Call.episode_id, Call.endpoint, Call.model, Call.status,
                   Call.http_status, Call.t_start, Call.t_end, Call.prompt_tokens,
                   Call.completion_tokens, Call.stored_at)
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
            select(Call.call_id, Call.episode_id, Call.endpoint, Call.model, Call.status,
                   Call.http_status, Call.t_start, Call.t_end, Call.prompt_tokens,
                   Call.completion_tokens, Call.stored_at)
            .order_by(Call.stored_at.desc(), Call.call_id.desc()).limit(limit))).all()
    return [LiveCall(**r._mapping) for r in rows]


async def episode_stamp(engine: AsyncEngine, episode_id: str) -> tuple[int, float | None]:
    """(calls, latest stored_at) of an episode: changes whenever a call is added."""
    async with engine.connect() as conn:
        row = (await conn.execute(
            select(func.count(), func.max(Call.stored_at))
            .where(Call.episode_id == episode_id))).one()
    return int(row[0]), row[1]
