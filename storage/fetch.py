"""Driver-level reads shared by the bulk readers: rows straight from the driver, and an
IN list of any length as one bound parameter."""

from __future__ import annotations

import msgspec
from sqlalchemy import String, any_, bindparam, func, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql import Select


def among(column, values: list[str], engine: AsyncEngine):
    """``column IN values`` as one bound parameter however many values there are (a JSON
    array on SQLite, a text array on Postgres): an IN list of thousands of literals costs
    more to compile than the query costs to run, and has a parameter limit."""
    if engine.dialect.name == "postgresql":
        return column == any_(bindparam(None, list(values), type_=ARRAY(String)))
    given = func.json_each(bindparam(None, msgspec.json.encode(values).decode(), type_=String))
    return column.in_(select(given.table_valued("value").c.value))


async def fetch(conn: AsyncConnection, query: Select) -> list:
    """``query``'s rows as tuples (asyncpg Records on Postgres), from the driver itself."""
    compiled = query.compile(dialect=conn.dialect, compile_kwargs={"render_postcompile": True})
    params = [compiled.params[name] for name in compiled.positiontup or ()]
    driver = (await conn.get_raw_connection()).driver_connection
    if conn.dialect.name == "postgresql":
        return await driver.fetch(str(compiled), *params)
    return list(await driver.execute_fetchall(str(compiled), params))
