"""What the viewer's lineage tree reads of one episode: its calls as lineage assignment
sees them (exporters.lineages), the episode it is a sub-agent of, and those that are
sub-agents of it (registered with ``parent``; indexed since 0015)."""

from __future__ import annotations

import msgspec
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.storage.details import COMPLETED
from tracetap.storage.tables import Call, Choice, Episode

MAX_CHILDREN = 200  # sub-agent episodes listed on one page (the count is said in full)
TOOL_FINISH = ("tool_calls", "tool_use", "function_call")  # exporters.lineages.TOOL_FINISH


class TreeCall(msgspec.Struct, kw_only=True, gc=False):
    call_id: str
    seq: int
    t_start: float
    t_end: float | None
    conversation: str | None
    lineage: str | None
    parent_lineage: str | None
    failed: bool
    asked_tool: bool = False


class Relative(msgspec.Struct, kw_only=True, gc=False):
    id: str
    task_id: str | None
    reward: float | None
    finished: bool


class Relatives(msgspec.Struct, kw_only=True):
    parent: Relative | None  # None: a root episode, or its parent is not stored
    parent_id: str | None  # as registered, even when that episode is not stored
    children: list[Relative]  # the first MAX_CHILDREN, oldest first
    children_total: int


async def tree_calls(engine: AsyncEngine, episode_id: str) -> list[TreeCall]:
    """The episode's calls in arrival order (t_start, instance, seq), each with whether
    one of its choices finished asking for a tool."""
    async with engine.connect() as conn:
        rows = (await conn.execute(
            select(Call.call_id, Call.seq, Call.t_start, Call.t_end, Call.conversation,
                   Call.lineage, Call.parent_lineage, Call.status, Call.http_status)
            .where(Call.episode_id == episode_id)
            .order_by(Call.t_start, Call.instance, Call.seq))).all()
        asked = set((await conn.execute(
            select(Choice.call_id).where(
                Choice.call_id.in_(select(Call.call_id).where(Call.episode_id == episode_id)),
                Choice.finish_reason.in_(TOOL_FINISH)))).scalars())
    return [TreeCall(call_id=r[0], seq=r[1], t_start=r[2], t_end=r[3], conversation=r[4],
                     lineage=r[5], parent_lineage=r[6],
                     failed=r[8] != 200 or r[7] not in COMPLETED,
                     asked_tool=r[0] in asked) for r in rows]


async def relatives(engine: AsyncEngine, episode_id: str) -> Relatives:
    columns = (Episode.id, Episode.task_id, Episode.reward, Episode.finished_at)
    async with engine.connect() as conn:
        parent_id = (await conn.execute(
            select(Episode.parent_id).where(Episode.id == episode_id))).scalar()
        parent = None
        if parent_id is not None:
            row = (await conn.execute(select(*columns).where(Episode.id == parent_id))).first()
            parent = None if row is None else _relative(row)
        children = (await conn.execute(
            select(*columns).where(Episode.parent_id == episode_id)
            .order_by(Episode.created_at, Episode.id).limit(MAX_CHILDREN))).all()
        total = len(children)
        if total == MAX_CHILDREN:
            total = (await conn.execute(select(func.count()).select_from(Episode).where(
                Episode.parent_id == episode_id))).scalar_one()
    return Relatives(parent=parent, parent_id=parent_id,
                     children=[_relative(r) for r in children], children_total=total)


def _relative(row) -> Relative:
    return Relative(id=row[0], task_id=row[1], reward=row[2], finished=row[3] is not None)
