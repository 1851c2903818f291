"""Alembic: the only way the schema changes; ``upgrade`` and friends for the commands.

Here and not in storage, which must not import upward (docs/architecture.md): the
migrations know storage's tables, storage knows nothing of the migrations.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tracetap.storage.engine import (
    DatabaseUnavailable,
    async_url,
    create_engine,
    ensure_sqlite_dir,
    is_sqlite,
    redact_url,
)


def alembic_config(url: str):
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(Path(__file__).parent))
    # Escape % for ConfigParser interpolation (passwords may contain it).
    config.set_main_option("sqlalchemy.url", async_url(url).replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the schema at ``url`` up to ``revision``. Call from sync code only."""
    from alembic import command
    from sqlalchemy.exc import SQLAlchemyError

    target = async_url(url)
    if target.startswith("sqlite"):
        ensure_sqlite_dir(target)
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
                lambda sync: MigrationContext.configure(sync).get_current_revision()
            )
    except (SQLAlchemyError, OSError) as exc:
        raise DatabaseUnavailable(
            f"cannot reach {redact_url(url)}: {getattr(exc, 'orig', None) or exc}"
        ) from exc
    finally:
        await engine.dispose()


async def upgrade_async(url: str) -> None:
    """The same, from inside a running event loop (Alembic's env runs its own loop)."""
    await asyncio.to_thread(upgrade, url)
