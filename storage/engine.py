"""Database URLs, async engines and schema upgrades (Alembic is the only way in)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from tracetap import migrations

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


def is_sqlite(url: str) -> bool:
    return async_url(url).startswith("sqlite")


def create_engine(url: str, **kwargs) -> AsyncEngine:
    target = async_url(url)
    if target.startswith("sqlite"):
        _ensure_sqlite_dir(target)
        engine = create_async_engine(target, **kwargs)
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return create_async_engine(target, **kwargs)


def _ensure_sqlite_dir(target: str) -> None:
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


def alembic_config(url: str):
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    # Escape % for ConfigParser interpolation (passwords may contain it).
    config.set_main_option("sqlalchemy.url", async_url(url).replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the schema at ``url`` up to ``revision``. Call from sync code only."""
    from alembic import command
    from sqlalchemy.exc import SQLAlchemyError

    target = async_url(url)
    if target.startswith("sqlite"):
        _ensure_sqlite_dir(target)
    try:
        command.upgrade(alembic_config(url), revision)
    except (SQLAlchemyError, OSError) as exc:
        raise DatabaseUnavailable(
            f"cannot migrate {redact_url(url)}: {getattr(exc, 'orig', None) or exc}"
        ) from exc


def revisions(url: str) -> tuple[str | None, str]:
    """The schema revision ``url`` is at (None: no schema yet) and the newest one."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    return asyncio.run(_current_revision(url)), head


def prepare_schema(url: str) -> None:
    """On start: migrate the embedded SQLite; require an up-to-date Postgres.

    Postgres is shared by replicas, so its schema changes only through an explicit
    ``tracetap db upgrade`` (two replicas migrating at once would race).
    """
    if is_sqlite(url):
        upgrade(url)
        return
    current, head = revisions(url)
    if current != head:
        raise DatabaseUnavailable(
            f"the schema of {redact_url(url)} is at revision {current or 'none'}, not {head}: "
            f"run `tracetap db upgrade --db {redact_url(url)}` first"
        )


async def _current_revision(url: str) -> str | None:
    from alembic.migration import MigrationContext
    from sqlalchemy.exc import SQLAlchemyError

    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(
                lambda sync: MigrationContext.configure(sync).get_current_revision())
    except (SQLAlchemyError, OSError) as exc:
        raise DatabaseUnavailable(
            f"cannot reach {redact_url(url)}: {getattr(exc, 'orig', None) or exc}") from exc
    finally:
        await engine.dispose()


async def upgrade_async(url: str) -> None:
    """The same, from inside a running event loop (Alembic's env runs its own loop)."""
    await asyncio.to_thread(upgrade, url)
