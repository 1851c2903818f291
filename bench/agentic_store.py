"""What the agentic replay left in the database: bytes, calls, stored token ids.

The byte count is what the run added to a freshly migrated database (SQLite: the file
and its WAL; Postgres: ``pg_total_relation_size`` of every table, TOAST and indexes
included). Stored ids are the token ids held for prompts and completions, each block
once (storage.footprint).
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import asyncpg
from pgtemp import create_database

from tracetap.migrations import upgrade
from tracetap.storage import queries
from tracetap.storage.engine import create_engine
from tracetap.storage.footprint import StoredIds, stored_ids

# Every call the load generator made and its status; the ids come from
# storage.footprint.stored_ids (blocks each counted once, or inline arrays).
_CALLS = "SELECT count(*), sum(CASE WHEN status = 'ok' THEN 1 ELSE 0 END) FROM calls"
_PG_SIZE = ("SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'public' AND c.relkind = 'r'")


def empty_database(arm: str, folder: Path) -> tuple[str, int]:
    """A fresh, migrated database for one arm, and its size before the run."""
    folder.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{folder / 'tracetap.db'}" if arm == "sqlite" else create_database()
    upgrade(url)
    return url, _size(url)


def _sqlite_path(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///"))


def _size(url: str) -> int:
    if url.startswith("sqlite"):
        path = _sqlite_path(url)
        return sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal"))
                   if p.exists())
    return int(asyncio.run(_pg(url, _PG_SIZE))[0][0])


async def _pg(url: str, *queries: str) -> list[tuple]:
    conn = await asyncpg.connect(url)
    try:
        return [tuple(await conn.fetchrow(q)) for q in queries]
    finally:
        await conn.close()


async def _stored_prompts(url: str, episode: str) -> list[tuple[list[int] | None, list[int]]]:
    engine = create_engine(url)
    try:
        calls = await queries.calls_of(engine, episode)
    finally:
        await engine.dispose()
    return [(c["prompt_ids"], c["choices"][0]["completion_ids"] if c["choices"] else [])
            for c in sorted(calls, key=lambda c: c["seq"])]


def stored_ids_match(url: str, episode: str, session) -> bool:
    """Whether each call of ``episode`` is stored with exactly ``session``'s prompt and
    completion ids, turn by turn (read back through tracetap's own queries)."""
    stored = asyncio.run(_stored_prompts(url, episode))
    return len(stored) == session.sizes.turns and all(
        prompt == session.prompt_ids(t) and completion == session.outs[t]
        for t, (prompt, completion) in enumerate(stored))


async def _stored_ids(url: str) -> StoredIds:
    engine = create_engine(url)
    try:
        return await stored_ids(engine)
    finally:
        await engine.dispose()


def database_figures(arm: str, url: str, empty: int) -> dict:
    if url.startswith("sqlite"):
        with sqlite3.connect(_sqlite_path(url)) as conn:
            calls = conn.execute(_CALLS).fetchone()
    else:
        (calls,) = asyncio.run(_pg(url, _CALLS))
    count, ok = (int(v or 0) for v in calls)
    ids = asyncio.run(_stored_ids(url))
    return {"bytes": _size(url) - empty, "calls": count, "calls_ok": ok,
            "stored_ids": ids.total, "prompt_tokens": ids.prompt_tokens,
            "completion_ids": ids.completion}
