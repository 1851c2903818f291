"""One insert run often (a call's intent, storage.intents) on a Postgres connection kept
checked out: the driver's prepared statement, no pool checkout or statement compile per
run. Measured in process: ~0.3 ms of CPU less per run than the same insert through the
pool and SQLAlchemy, paid by every call a replica answers. The replica's other periodic
statements (its lease each second, the cleanup of stored intents) run on it too
(``execute``): an idle replica's lease was the largest part of its CPU.

Rows that already exist are skipped (``ON CONFLICT DO NOTHING``), so a run that failed
can be repeated. Any failure gives the connection up (invalidated, not pooled again); the
next run takes a fresh one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Table
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine


class HeldInsert:
    def __init__(self, engine: AsyncEngine, table: Table, columns: Sequence[str]):
        self.engine = engine
        self.columns = tuple(columns)
        names = ", ".join(f'"{c}"' for c in self.columns)
        values = ", ".join(f"${i}" for i in range(1, len(self.columns) + 1))
        self.sql = (f'INSERT INTO "{table.name}" ({names}) VALUES ({values}) '
                    "ON CONFLICT DO NOTHING")
        self._conn: AsyncConnection | None = None
        self._driver: Any = None  # asyncpg's connection under _conn

    async def run(self, rows: Sequence[dict]) -> None:
        """Insert ``rows`` (dicts with every column), in one implicit transaction."""
        if self._driver is None:
            await self._take()
        try:
            await self._driver.executemany(
                self.sql, [tuple(row[c] for c in self.columns) for row in rows])
        except BaseException:
            await self.release(broken=True)
            raise

    async def execute(self, sql: str, *args: Any) -> str:
        """Run one other statement (``$1``-style arguments) on the kept connection; its
        status (``DELETE 3``)."""
        if self._driver is None:
            await self._take()
        try:
            return await self._driver.execute(sql, *args)
        except BaseException:
            await self.release(broken=True)
            raise

    async def _take(self) -> None:
        conn = await self.engine.connect()
        try:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            self._driver = (await conn.get_raw_connection()).driver_connection
        except BaseException:
            await conn.close()
            raise
        self._conn = conn

    async def release(self, broken: bool = False) -> None:
        """Hand the connection back (``broken``: invalidated, never reused)."""
        conn, self._conn, self._driver = self._conn, None, None
        if conn is None:
            return
        with contextlib.suppress(Exception):
            if broken:
                await conn.invalidate()
            await conn.close()
