"""Database URLs and async engines (the schema is migrations' job)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

# "postgres://" is what Heroku-style providers and many .env files give.
_ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+asyncpg",
                  "postgres": "postgresql+asyncpg"}


class DatabaseURLError(ValueError):
    """The --db value is not a URL tracetap can store into."""


class DatabaseUnavailable(OSError):
    """The database could not be reached or migrated (a clear message for the CLI)."""


def async_url(url: str) -> str:
    """Map a user-facing URL (``sqlite:///x.db``, ``postgresql://...``) to its async driver."""
    try:
        parsed = make_url(url)
    except Exception as exc:
        raise DatabaseURLError(f"not a database URL: {_masked(url)}: use sqlite:///path.db "
                               "or postgresql://user@host/db") from exc
    backend = parsed.get_backend_name()
    if backend not in _ASYNC_DRIVERS:
        raise DatabaseURLError(f"unsupported database {backend!r} in {redact_url(url)}: use "
                               "sqlite:///path.db or postgresql://user@host/db")
    return parsed.set(drivername=_ASYNC_DRIVERS[backend]).render_as_string(hide_password=False)


def redact_url(url: str) -> str:
    """The URL with its password masked, for log lines."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return _masked(url)


def _masked(text: str) -> str:
    """A URL too broken to parse, echoed with anything like a password masked."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", text)


@asynccontextmanager
async def one_statement(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A connection for one statement (a poll's read, a heartbeat's upsert), committed.
    On Postgres it runs in autocommit: one round trip where a transaction costs three
    (BEGIN, the statement, COMMIT or ROLLBACK); a single statement is atomic either way.
    SQLite keeps its transaction (switching aiosqlite's isolation level costs more)."""
    if engine.dialect.name != "postgresql":
        async with engine.begin() as conn:
            yield conn
        return
    async with engine.connect() as conn:
        yield await conn.execution_options(isolation_level="AUTOCOMMIT")


def is_sqlite(url: str) -> bool:
    return async_url(url).startswith("sqlite")


def create_engine(url: str, **kwargs) -> AsyncEngine:
    target = async_url(url)
    if target.startswith("sqlite"):
        ensure_sqlite_dir(target)
        engine = create_async_engine(target, **kwargs)
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return create_async_engine(target, **kwargs)


def ensure_sqlite_dir(target: str) -> None:
    path = make_url(target).database
    if path and path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    # WAL lets the exporter read while the proxy writes; NORMAL sync is durable
    # enough because the journal holds every record until its batch commits.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.close()
