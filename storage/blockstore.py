"""The database side of the block store: the lock that keeps prune's sweep and the writer
apart, the sweep's serial, and the last stored call of conversations the cache forgot.

Every function takes the driver connection (asyncpg, or aiosqlite's) inside the writer's
transaction (storage.rows.insert_calls) or the sweep's (storage.retention).

Why a lock: the writer leaves out of a batch the blocks it knows are stored (those of a
conversation's previous call); the sweep deletes blocks no call references. Run at the
same time, the writer could reference a block the sweep has just judged unreferenced.
So the writer holds a shared lock for its transaction and the sweep an exclusive one
(Postgres: a transaction-level advisory lock; SQLite: the database's one write lock,
taken at BEGIN IMMEDIATE), and the sweep raises the ``blocks_swept`` serial, which tells
every writer to forget what it knew (storage.dedup.BlockCache.valid_for).
"""

from __future__ import annotations

import time

from tracetap.storage.dedup import Last, last_of

LOCK_KEY = 0x7472_6163_6574_6170  # "tracetap": the advisory lock of the block store
SWEPT = "blocks_swept"  # controls row: raised by every sweep that deleted blocks
_REFS = "prompt_refs, request_refs, upstream_request_refs, response_refs"


async def begin_writing(raw, dialect: str) -> int:
    """Open the writer's transaction (SQLite) or take its shared lock (Postgres: call
    inside ``raw.transaction()``); returns the sweep serial in force."""
    if dialect == "postgresql":
        await raw.execute(f"SELECT pg_advisory_xact_lock_shared({LOCK_KEY})")
        value = await raw.fetchval("SELECT serial FROM controls WHERE name = $1", SWEPT)
        return int(value or 0)
    await raw.execute("BEGIN IMMEDIATE")
    rows = await raw.execute_fetchall("SELECT serial FROM controls WHERE name = ?", (SWEPT,))
    return int(rows[0][0]) if rows else 0


async def begin_sweeping(raw, dialect: str) -> None:
    """Take the exclusive lock (inside the sweep's transaction): writers wait meanwhile."""
    if dialect == "postgresql":
        await raw.execute(f"SELECT pg_advisory_xact_lock({LOCK_KEY})")
    else:
        await raw.execute("BEGIN IMMEDIATE")


async def mark_swept(raw, dialect: str) -> None:
    """Raise the sweep serial, in the sweep's transaction."""
    now = time.time()
    if dialect == "postgresql":
        await raw.execute(
            "INSERT INTO controls (name, value, serial, updated_at) VALUES ($1, NULL, 1, $2) "
            "ON CONFLICT (name) DO UPDATE SET serial = controls.serial + 1, updated_at = $2",
            SWEPT, now)
    else:
        await raw.execute(
            "INSERT INTO controls (name, value, serial, updated_at) VALUES (?, NULL, 1, ?) "
            "ON CONFLICT (name) DO UPDATE SET serial = serial + 1, "
            "updated_at = excluded.updated_at",
            (SWEPT, now))


async def last_calls(raw, dialect: str, episode_ids: list[str]) -> dict[str, Last]:
    """The last stored call with prompt ids of each of these conversations (those that
    have one)."""
    out: dict[str, Last] = {}
    for start in range(0, len(episode_ids), 500):
        chunk = episode_ids[start:start + 500]
        if dialect == "postgresql":
            rows = await raw.fetch(
                f"SELECT DISTINCT ON (episode_id) episode_id, {_REFS} FROM calls "
                "WHERE episode_id = ANY($1::text[]) AND prompt_refs IS NOT NULL "
                "ORDER BY episode_id, t_start DESC, seq DESC", chunk)
        else:
            marks = ", ".join("?" * len(chunk))
            rows = await raw.execute_fetchall(
                f"SELECT episode_id, {_REFS} FROM calls WHERE episode_id IN ({marks}) "
                "AND prompt_refs IS NOT NULL "
                "ORDER BY episode_id, t_start, seq", chunk)
        for row in rows:  # SQLite: the last row of an episode wins
            out[row[0]] = last_of(row[1], list(row[2:]))
    return out
