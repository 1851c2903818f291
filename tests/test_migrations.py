"""The Alembic migrations and the SQLAlchemy models describe the same schema."""

from __future__ import annotations

import asyncio

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from tracetap.storage.engine import create_engine
from tracetap.storage.tables import metadata


def _diff(url: str) -> list:
    async def run():
        engine = create_engine(url)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(
                    lambda sync: compare_metadata(MigrationContext.configure(sync), metadata))
        finally:
            await engine.dispose()

    return asyncio.run(run())


def test_autogenerate_finds_no_difference(db_url):
    assert _diff(db_url) == []
