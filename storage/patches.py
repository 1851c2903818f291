"""The ``overlay_patches`` table: runtime overlay patches, by name (docs/overlays.md).

Written by the admin API, read by a process the first time one of its calls names a patch
it has not loaded; never on the model-call path otherwise.
"""

from __future__ import annotations

import json
import time
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.storage.engine import one_statement
from tracetap.storage.notify import PATCHES, send
from tracetap.storage.rows import dialect_insert
from tracetap.storage.tables import OverlayPatch

_COLUMNS = (
    OverlayPatch.name,
    OverlayPatch.sha256,
    OverlayPatch.hooks,
    OverlayPatch.after_model_sees,
    OverlayPatch.created_at,
)


def _row(row, source: str | None = None) -> dict[str, Any]:
    out = {
        "name": row.name,
        "sha256": row.sha256,
        "hooks": json.loads(row.hooks),
        "after_model_sees": row.after_model_sees,
        "created_at": row.created_at,
    }
    if source is not None:
        out["source"] = source
    return out


async def add(
    engine: AsyncEngine,
    *,
    name: str,
    sha256: str,
    source: str,
    hooks: list[str],
    after_model_sees: str,
) -> dict[str, Any]:
    """Store a patch unless one of that name exists; returns the stored one (which is
    another patch when the name was taken first: the caller compares sha256)."""
    insert = (
        dialect_insert(engine.dialect.name, OverlayPatch.__table__)
        .values(
            name=name,
            sha256=sha256,
            source=source,
            hooks=json.dumps(hooks),
            after_model_sees=after_model_sees,
            created_at=time.time(),
        )
        .on_conflict_do_nothing(index_elements=[OverlayPatch.name])
    )
    async with engine.begin() as conn:
        await conn.execute(insert)
        await send(conn, PATCHES)  # the processes that know of no patch look now
        row = (
            await conn.execute(
                select(*_COLUMNS, OverlayPatch.source).where(OverlayPatch.name == name)
            )
        ).one()
    return _row(row, row.source)


async def get(engine: AsyncEngine, name: str) -> dict[str, Any] | None:
    """One patch with its source, or None."""
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                select(*_COLUMNS, OverlayPatch.source).where(OverlayPatch.name == name)
            )
        ).first()
    return None if row is None else _row(row, row.source)


async def listed(engine: AsyncEngine) -> list[dict[str, Any]]:
    """Every patch, without its source, by name."""
    async with engine.connect() as conn:
        rows = await conn.execute(select(*_COLUMNS).order_by(OverlayPatch.name))
        return [_row(row) for row in rows]


async def any_stored(engine: AsyncEngine) -> bool:
    async with one_statement(engine) as conn:  # polled until a patch is known
        return (await conn.execute(select(OverlayPatch.name).limit(1))).first() is not None


async def remove(engine: AsyncEngine, name: str) -> bool:
    """Delete a patch; whether there was one."""
    async with engine.begin() as conn:
        result = await conn.execute(delete(OverlayPatch).where(OverlayPatch.name == name))
        return result.rowcount > 0
