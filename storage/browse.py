"""Pages of episodes and groups for the trace viewer: filtered, sorted, paged lists and
the sample behind their charts.

Not on the model-call path, and never a copy of the export's reads: token arrays and the
trajectory merge come from storage.scan and exporters.trajectories. Everything here is
small per request (a page of rows), so that a database of 100,000 episodes answers as
fast as one of ten. One episode or call: storage.details; what is new: storage.changes.
"""

from __future__ import annotations

import msgspec
from sqlalchemy import case, func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.storage.tables import FAILED_SQL, Call, Episode

SORTS = {
    "created": Episode.created_at,
    "finished": Episode.finished_at,
    "reward": Episode.reward,
    "id": Episode.id,
    "group": Episode.group_id,
    "task": Episode.task_id,
}
STATUSES = ("ok", "errors", "budget_exceeded")  # of an episode's calls


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
    context_tokens: int = 0  # its longest call's prompt + completion: the trajectory's length
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


class ChartSample(msgspec.Struct, kw_only=True):
    """The most recent episodes matching a query, for the episodes page's charts."""

    rewards: list[float]
    calls_per_episode: list[int]
    tokens_per_episode: list[int]
    # (t_start, duration, time to first byte or None) of their calls
    latencies: list[tuple[float, float, float | None]]
    episodes: int


# The partial index's own predicate, as literal SQL: the planner uses the index only when
# the query's condition is the same (bound parameters would not match it).
_FAILED = text(f"({FAILED_SQL})")


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


async def episode_page(engine: AsyncEngine, query: EpisodeQuery, extra: tuple = (),
                       count_cap: int | None = None) -> EpisodePage:
    """One page of matching episodes with their call counts, tokens and failures.
    ``extra``: more conditions (storage.search); ``count_cap``: count at most one more
    than this many (a search matching most episodes need not count them all)."""
    conditions = [*_conditions(query), *extra]
    columns = (Episode.id, Episode.group_id, Episode.task_id, Episode.harness_name,
               Episode.created_at, Episode.finished_at, Episode.reward, Episode.outcome)
    counted = select(func.count()).select_from(Episode).where(*conditions) \
        if count_cap is None else select(func.count()).select_from(
            select(Episode.id).where(*conditions).limit(count_cap + 1).subquery())
    async with engine.connect() as conn:
        if query.offset == 0:
            # The first page first: a short one is every match, so nothing is left to
            # count (a search with few matches walks the episodes once, not twice).
            rows = (await conn.execute(select(*columns).where(*conditions)
                                       .order_by(*_order(query, False)).limit(query.limit))).all()
            total = len(rows) if len(rows) < query.limit else \
                (await conn.execute(counted)).scalar() or 0
        else:
            total = (await conn.execute(counted)).scalar() or 0
            rows = await _page(conn, query, columns, conditions, total, count_cap)
        stats = await _call_stats(conn, [r.id for r in rows])
    out = []
    for r in rows:
        row = EpisodeRow(**r._mapping)
        stat = stats.get(r.id)
        if stat is not None:
            (row.calls, row.failed_calls, budget, row.prompt_tokens, row.completion_tokens,
             row.first_start, row.last_end, row.context_tokens) = stat
            row.budget_exceeded = bool(budget)
        out.append(row)
    return EpisodePage(rows=out, total=int(total), query=query)


async def _page(conn, query: EpisodeQuery, columns: tuple, conditions: list, total: int,
                count_cap: int | None) -> list:
    """A page after the first. One past the middle is read from the other end: OFFSET
    walks every row it skips, so the last page of 100,000 costs what the first does."""
    backwards = query.offset > total // 2 and (count_cap is None or total <= count_cap)
    offset = max(0, total - query.offset - query.limit) if backwards else query.offset
    limit = min(query.limit, max(total - query.offset, 0)) if backwards else query.limit
    rows = (await conn.execute(
        select(*columns).where(*conditions).order_by(*_order(query, backwards))
        .limit(limit).offset(offset))).all()
    if backwards:
        rows.reverse()
    return rows


async def _call_stats(conn, ids: list[str]) -> dict[str, tuple]:
    if not ids:
        return {}
    failed = func.sum(case((_FAILED, 1), else_=0))
    budget = func.sum(case((Call.status == "budget_exceeded", 1), else_=0))
    rows = (await conn.execute(
        select(Call.episode_id, func.count(), failed, budget,
               func.coalesce(func.sum(Call.prompt_tokens), 0),
               func.coalesce(func.sum(Call.completion_tokens), 0),
               func.min(Call.t_start), func.max(Call.t_end),
               func.max(func.coalesce(Call.prompt_tokens, 0)
                        + func.coalesce(Call.completion_tokens, 0)))
        .where(Call.episode_id.in_(ids)).group_by(Call.episode_id))).all()
    return {r[0]: (int(r[1]), int(r[2] or 0), int(r[3] or 0), int(r[4]), int(r[5]), r[6], r[7],
                   int(r[8] or 0)) for r in rows}


def _group_order(query: EpisodeQuery, latest) -> list:
    """ORDER BY for groups, by the episodes page's sort keys read per group: created and
    finished by the group's latest, reward by its mean, task by its first."""
    keys = {"created": latest, "finished": func.max(Episode.finished_at),
            "reward": func.avg(Episode.reward), "id": Episode.group_id,
            "group": Episode.group_id, "task": func.min(Episode.task_id)}
    if query.sort not in keys:
        raise ValueError(f"sort must be one of {', '.join(keys)}")
    key = keys[query.sort]
    key = (key.desc() if query.descending else key.asc()).nulls_last()
    return [key] if query.sort in ("id", "group") else [key, Episode.group_id]


async def group_page(engine: AsyncEngine, query: EpisodeQuery) -> GroupPage:
    """Groups (GRPO) with a matching episode, in the query's order (newest first by
    default), each with all its members."""
    conditions = [*_conditions(query), Episode.group_id.is_not(None)]
    latest = func.max(Episode.created_at).label("latest")
    async with engine.connect() as conn:
        # COUNT over a GROUP BY hashes; COUNT(DISTINCT) sorts, at twice the time.
        total = (await conn.execute(select(func.count()).select_from(
            select(Episode.group_id).where(*conditions).group_by(Episode.group_id)
            .subquery()))).scalar()
        groups = (await conn.execute(
            select(Episode.group_id, latest).where(*conditions).group_by(Episode.group_id)
            .order_by(*_group_order(query, latest)).limit(query.limit)
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
        # The trajectory's length (context_tokens), not usage summed over the calls.
        counts[1] = max(counts[1], (c.prompt_tokens or 0) + (c.completion_tokens or 0))
        if c.t_end is not None:
            ttft = None if c.t_first_byte is None else c.t_first_byte - c.t_start
            latencies.append((c.t_start, c.t_end - c.t_start, ttft))
    return ChartSample(
        rewards=[e.reward for e in episodes if e.reward is not None],
        calls_per_episode=[v[0] for v in per_episode.values()],
        tokens_per_episode=[v[1] for v in per_episode.values()],
        latencies=sorted(latencies), episodes=len(ids))


async def group_rewards(engine: AsyncEngine, group_id: str) -> list[GroupMember]:
    async with engine.connect() as conn:
        rows = (await conn.execute(
            select(Episode.id, Episode.reward, Episode.outcome, Episode.finished_at)
            .where(Episode.group_id == group_id).order_by(Episode.id))).all()
    return [GroupMember(**r._mapping) for r in rows]
