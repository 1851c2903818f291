"""Records to rows, inserted idempotently (replaying a journal twice stores once)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Iterator

import msgspec
from sqlalchemy import column, table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.storage.blockstore import begin_writing, last_calls
from tracetap.storage.codec import pack_ids, pack_logprobs
from tracetap.storage.conversation import Readers
from tracetap.storage.dedup import BlockCache, packed_prompt, plan
from tracetap.storage.policy_spans import encode_spans
from tracetap.storage.records import CallRecord, has_prompt_ids
from tracetap.storage.search_index import index_calls
from tracetap.storage.tables import Block, Call, Choice

_json = msgspec.json.encode
# An episode first seen through a call gets its id, first time and registered=False; every
# other column is null, so they are left out of the INSERT (a journal replayed into a
# database one migration behind this code still stores its calls).
_EPISODE_STUB = table("episodes", column("id"), column("created_at"), column("registered"))
_INSERTS = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}


def dialect_insert(dialect: str, table):
    """An INSERT that has ``on_conflict_do_*`` (Postgres and SQLite both have them)."""
    return _INSERTS[dialect](table)


def insert_ignoring_duplicates(dialect: str, table):
    return dialect_insert(dialect, table).on_conflict_do_nothing()


_INLINE = {"prompt_refs": None, "request_refs": None, "upstream_request_refs": None,
           "response_refs": None}


def call_row(record: CallRecord, stored_at: float, refs: dict | None = None) -> dict:
    """The calls row of ``record``: prompt ids and bodies as ``refs`` (storage.dedup), or
    inline as before revision 0007 when there are none."""
    row = {
        "call_id": record.call_id,
        "episode_id": record.episode_id,
        "seq": record.seq,
        "instance": record.instance,
        "endpoint": record.endpoint,
        "model": record.model,
        "policy_version": record.policy_version,
        "stream": record.stream,
        "upstream": record.upstream,
        "request": record.request,
        "response": record.response,
        "status": record.status,
        "http_status": record.http_status,
        "error": record.error,
        "t_start": record.t_start,
        "t_first_byte": record.t_first_byte,
        "t_end": record.t_end,
        "upstream_latency": record.upstream_latency,
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "prompt_ids": None,  # inline only without refs (below)
        "prompt_source": record.prompt_source or (
            "engine" if has_prompt_ids(record) else "none"),
        "upstream_request": record.upstream_request,
        "ids_missing": record.ids_missing,
        "overlay": record.overlay,
        "translation_dropped": record.translation_dropped,
        "lineage": record.lineage,
        "parent_lineage": record.parent_lineage,
        "conversation": record.conversation,
        "stored_at": stored_at,
    }
    if refs is None:
        row.update(_INLINE, prompt_ids=packed_prompt(record))
    else:
        row.update(refs, prompt_ids=None, request=None, upstream_request=None, response=None)
    return row


_CHOICE_INLINE = {"text_refs": None, "completion_ids_refs": None,
                  "completion_logprobs_refs": None, "routed_experts_refs": None}


def choice_rows(record: CallRecord, refs: dict[int, dict] | None = None) -> list[dict]:
    """The choices rows of ``record``: text, ids and logprobs as ``refs`` (by choice
    index, storage.dedup), or inline as before revision 0007 when there are none."""
    rows = [
        {
            "call_id": record.call_id,
            "choice_index": choice.index,
            "finish_reason": choice.finish_reason,
            "text": choice.text,
            "completion_ids": pack_ids(choice.completion_ids),
            "completion_logprobs": pack_logprobs(choice.completion_logprobs),
            "top_logprobs": None if choice.top_logprobs is None
            else _json(choice.top_logprobs).decode(),
            "token_source": choice.token_source,
            "policy_spans": encode_spans(choice.policy_spans),
        }
        for choice in record.choices
    ]
    for row in rows:
        if refs is None:
            row.update(_CHOICE_INLINE)
        else:
            row.update(refs[row["choice_index"]], text=None, completion_ids=None,
                       completion_logprobs=None)
    return rows


def episode_rows(records: list[CallRecord]) -> list[dict]:
    """Episodes first seen through a call: created on first use, never overwritten."""
    first: dict[str, float] = {}
    for record in records:
        if record.episode_id is not None:
            t = first.get(record.episode_id)
            first[record.episode_id] = record.t_start if t is None else min(t, record.t_start)
    return [{"id": eid, "created_at": t, "registered": False}
            for eid, t in first.items()]


def _postgres_insert(table) -> tuple[str, list[str]]:
    names = [c.name for c in table.columns]
    columns = ", ".join(f'"{n}"' for n in names)
    values = ", ".join(f"${i}" for i in range(1, len(names) + 1))
    return (f'INSERT INTO "{table.name}" ({columns}) VALUES ({values}) ON CONFLICT DO NOTHING',
            names)


def _sqlite_inserts(table, rows: list[dict]) -> Iterator[tuple[str, list]]:
    """Multi-row INSERTs, as few as SQLite's variable limit allows.

    One statement is one step, so aiosqlite's thread takes the GIL once per statement
    instead of once per row: under load the event loop holds the GIL, and a thread
    waiting for it per row wrote ten times slower than the proxy produced records.
    """
    names = [c.name for c in table.columns]
    columns = ", ".join(f'"{n}"' for n in names)
    row = "(" + ", ".join("?" * len(names)) + ")"
    most = 1 << ((_SQLITE_VARIABLES // len(names)).bit_length() - 1)
    start = 0
    while start < len(rows):
        # Power-of-two chunks: a few statement shapes, so sqlite3's statement cache
        # holds a handful of prepared statements, not one per batch size.
        size = min(most, 1 << ((len(rows) - start).bit_length() - 1))
        chunk = rows[start:start + size]
        start += size
        yield (f'INSERT INTO "{table.name}" ({columns}) VALUES {", ".join([row] * size)} '
               "ON CONFLICT DO NOTHING", [r[n] for r in chunk for n in names])


# Postgres batches go straight to asyncpg's executemany: the same SQL SQLAlchemy would
# send, at a third of the CPU (measured by bench/writer_bench.py).
_TABLES = (Block.__table__, _EPISODE_STUB, Call.__table__, Choice.__table__)
_PG_INSERTS = [_postgres_insert(t) for t in _TABLES]
_SQLITE_VARIABLES = 32766 if sqlite3.sqlite_version_info >= (3, 32) else 999


async def insert_calls(engine: AsyncEngine, records: list[CallRecord],
                       cache: BlockCache | None = None, *, search_index: bool = True,
                       readers: Readers | None = None) -> None:
    """Insert calls, their choices, any new episodes and the blocks their prompt ids and
    bodies reference (storage.dedup) in one transaction. ``cache``: the writer's memory
    of each conversation's last call, updated only once the transaction committed;
    ``search_index``: index the calls for the viewer's search (storage.search_index);
    ``readers``: where each API's requests hold their messages (storage.conversation;
    ``proxy.apis.registry.readers()``: without it bodies are stored and indexed whole)."""
    cache = cache or BlockCache()
    dialect = engine.dialect.name
    async with engine.connect() as conn:
        raw = (await conn.get_raw_connection()).driver_connection
        if dialect == "postgresql":
            async with raw.transaction():
                planned = await _plan(raw, dialect, records, cache, readers)
                for (sql, _), rows in zip(_PG_INSERTS, await _off_loop(
                        _pg_batches, records, planned)):
                    if rows:
                        await raw.executemany(sql, rows)
                if search_index:  # the viewer's search (0011, 0012)
                    await index_calls(raw, dialect, records, readers)
            cache.commit(planned)
            return
        try:
            planned = await _plan(raw, dialect, records, cache, readers)  # opens the transaction
            for table, rows in zip(_TABLES, await _off_loop(_batches, records, planned)):
                for sql, params in _sqlite_inserts(table, rows):
                    await raw.execute(sql, params)
            if search_index:  # the viewer's search (0011, 0012)
                await index_calls(raw, dialect, records, readers)
            await raw.commit()
        except BaseException:
            await raw.rollback()
            raise
        cache.commit(planned)


async def _plan(raw, dialect: str, records: list[CallRecord], cache: BlockCache,
                readers: Readers | None):
    cache.valid_for(await begin_writing(raw, dialect))
    episodes = {r.episode_id for r in records if r.episode_id is not None}
    parents = {e: last for e in episodes if (last := cache.get(e)) is not None}
    forgotten = sorted(episodes.difference(parents))
    if forgotten:
        parents.update(await last_calls(raw, dialect, forgotten))
    return await _off_loop(plan, records, parents, readers)


async def _off_loop(work, *args):
    """``work(*args)`` in a thread: cutting, hashing and packing a batch is CPU bound and
    grows with what the agent sent (a 5 MiB request of tiny messages is 170,000 blocks,
    seconds of CPU); on the event loop it would hold every other call that long. Pure
    functions of their arguments, so nothing else touches what they read meanwhile."""
    return await asyncio.to_thread(work, *args)


def _pg_batches(records: list[CallRecord], planned) -> list[list[tuple]]:
    """``_batches`` as asyncpg's executemany takes them: tuples in the columns' order."""
    return [[tuple(r[n] for n in names) for r in rows]
            for (_, names), rows in zip(_PG_INSERTS, _batches(records, planned))]


def _batches(records: list[CallRecord], planned) -> tuple[list[dict], ...]:
    stored_at = time.time()
    # In hash order: two writers inserting the same new blocks (a group's first prompts,
    # from two workers) take their row locks in one order and cannot deadlock.
    return ([{"hash": h, "data": data} for h, data in sorted(planned.blocks.items())],
            episode_rows(records),
            [call_row(r, stored_at, planned.calls[r.call_id].refs) for r in records],
            [row for r in records for row in choice_rows(r, planned.calls[r.call_id].choices)])
