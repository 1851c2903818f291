"""The Alembic migrations and the SQLAlchemy models describe the same schema."""

from __future__ import annotations

import asyncio

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from tracetap.storage.engine import create_engine
from tracetap.storage.tables import metadata


def _modelled(name, type_, parent) -> bool:
    # call_text's full-text indexes (0011, 0016) have no model: SQLite's FTS5 table and
    # its shadow tables, Postgres's GIN index of its words' buckets.
    return not (name or "").startswith(("call_text_fts", "ix_call_text_word_keys"))


def _has_model(item, name, type_, reflected, compare_to) -> bool:
    # Postgres's words of call_text and their keys (0016): SQLite has none, the model
    # neither.
    return not (type_ == "column" and name in ("words", "word_keys")
                and item.table.name == "call_text")


def _diff(url: str) -> list:
    async def run():
        engine = create_engine(url)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(lambda sync: compare_metadata(
                    MigrationContext.configure(sync, opts={"include_name": _modelled,
                                                           "include_object": _has_model}),
                    metadata))
        finally:
            await engine.dispose()

    return asyncio.run(run())


def test_autogenerate_finds_no_difference(db_url):
    assert _diff(db_url) == []
