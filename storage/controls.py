"""The ``controls`` table: shared switches (pause, policy version) and process heartbeats.

Read by every proxy process when a change notice comes (``storage.notify``) and every few
seconds besides, written by admin calls; never on the model-call path.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tracetap.storage.engine import one_statement
from tracetap.storage.notify import CONTROLS, send
from tracetap.storage.rows import dialect_insert
from tracetap.storage.tables import Control

HEARTBEAT = "worker:"


async def store(engine: AsyncEngine, name: str, value: str | None) -> int:
    """Set one control; returns its new serial (one more than the last, per row). Every
    process is notified of the change (heartbeats are ``beat``'s)."""
    insert = dialect_insert(engine.dialect.name, Control.__table__)
    now = time.time()
    statement = insert.values(name=name, value=value, serial=1, updated_at=now)
    statement = statement.on_conflict_do_update(
        index_elements=[Control.name],
        set_={"value": value, "serial": Control.serial + 1, "updated_at": now},
    )
    async with engine.begin() as conn:
        await conn.execute(statement)
        await send(conn, CONTROLS)
        # In the same transaction: the row is locked (Postgres) or the database is
        # (SQLite), so this is the serial of our own write.
        return (await conn.execute(select(Control.serial).where(Control.name == name))).scalar_one()


@asynccontextmanager
async def _on(target: AsyncEngine | AsyncConnection) -> AsyncIterator[AsyncConnection]:
    """``target`` itself when it is a connection (a follower's read and heartbeat share
    one on Postgres: one checkout and ping, not two), else one for one statement."""
    if isinstance(target, AsyncConnection):
        yield target
        return
    async with one_statement(target) as conn:
        yield conn


async def beat(target: AsyncEngine | AsyncConnection, instance: str, value: str) -> None:
    """Write this process's heartbeat: one statement (nobody reads a heartbeat's serial,
    and it sends no notice: only the pauser reads heartbeats)."""
    insert = dialect_insert(target.dialect.name, Control.__table__)
    now = time.time()
    statement = insert.values(name=HEARTBEAT + instance, value=value, serial=1, updated_at=now)
    statement = statement.on_conflict_do_update(index_elements=[Control.name],
                                                set_={"value": value, "updated_at": now})
    async with _on(target) as conn:
        await conn.execute(statement)


# The same two statements for a driver connection kept open (the listening one,
# storage.notify): prepared once, no pool or SQLAlchemy around them.
_READ_SQL = f"SELECT name, value, serial FROM {Control.__tablename__} WHERE name = ANY($1)"
_BEAT_SQL = (f"INSERT INTO {Control.__tablename__} (name, value, serial, updated_at) "
             "VALUES ($1, $2, 1, $3) ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value, "
             "updated_at = EXCLUDED.updated_at")


async def read_on(driver: Any, names: tuple[str, ...]) -> dict[str, tuple[str | None, int]]:
    """``read`` on an asyncpg connection."""
    rows = await driver.fetch(_READ_SQL, list(names))
    return {row["name"]: (row["value"], row["serial"]) for row in rows}


async def beat_on(driver: Any, instance: str, value: str) -> None:
    """``beat`` on an asyncpg connection."""
    await driver.execute(_BEAT_SQL, HEARTBEAT + instance, value, time.time())


async def read(target: AsyncEngine | AsyncConnection,
               names: tuple[str, ...]) -> dict[str, tuple[str | None, int]]:
    """``{name: (value, serial)}`` of the controls that were ever set."""
    async with _on(target) as conn:
        rows = await conn.execute(
            select(Control.name, Control.value, Control.serial).where(Control.name.in_(names))
        )
        return {name: (value, serial) for name, value, serial in rows}


async def peers(engine: AsyncEngine, since: float, besides: str) -> list[str | None]:
    """Heartbeat values of the other processes that reported after ``since``."""
    async with one_statement(engine) as conn:
        rows = await conn.execute(
            select(Control.value).where(
                Control.name.startswith(HEARTBEAT),
                Control.name != HEARTBEAT + besides,
                Control.updated_at >= since,
            )
        )
        return list(rows.scalars())


async def forget(engine: AsyncEngine, instance: str, older_than: float) -> None:
    """Delete this process's heartbeat and those no process refreshed since ``older_than``."""
    async with engine.begin() as conn:
        await conn.execute(delete(Control).where(Control.name == HEARTBEAT + instance))
        await conn.execute(
            delete(Control).where(
                Control.name.startswith(HEARTBEAT), Control.updated_at < older_than
            )
        )
