"""Which (task, harness config) pairs a harness has already run: what ``tracetap run
--space`` builds its assignment on, so a second run fills the gaps."""

from __future__ import annotations

from typing import Any

import msgspec
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.storage.tables import Episode


async def harness_configs(
    engine: AsyncEngine, harness: str, *, exclude_prefix: str | None = None
) -> dict[str, Any]:
    """Every distinct (task id, harness config) among the registered episodes of
    ``harness``, with its episode count, in (task id, config text) order.

    With ``exclude_prefix`` (a run's ``RUN.``), episodes whose id starts with it are left
    out, and so is every episode registered after the first of them: the basis a run saw
    when it started, the same on every resume (``before`` says when that was; None: no
    episode has the prefix yet)."""
    scope = [Episode.registered.is_(True), Episode.harness_name == harness]
    async with engine.connect() as conn:
        before = None
        if exclude_prefix:
            own = func.substr(Episode.id, 1, len(exclude_prefix)) == exclude_prefix
            before = (
                await conn.execute(select(func.min(Episode.created_at)).where(*scope, own))
            ).scalar()
            scope.append(~own)
            if before is not None:
                scope.append(Episode.created_at < before)
        rows = (
            await conn.execute(
                select(Episode.task_id, Episode.harness_config, func.count())
                .where(*scope)
                .group_by(Episode.task_id, Episode.harness_config)
                .order_by(Episode.task_id, Episode.harness_config)
            )
        ).all()
    data = [
        {
            "task_id": task,
            "config": None if text is None else msgspec.json.decode(text),
            "episodes": count,
        }
        for task, text, count in rows
    ]
    return {"harness": harness, "before": before, "data": data}
