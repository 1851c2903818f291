"""Database bytes per unique token for an agentic run, through the real storage code.

    python bench/storage_bytes.py                          # SQLite and Postgres, ~1 min
    python bench/storage_bytes.py --db sqlite --layout inline   # the layout before 0007
    python bench/storage_bytes.py --writer-cpu             # the writer's CPU per call
    python bench/storage_bytes.py --search-index off       # without the viewer's search index
    python bench/storage_bytes.py --writer-steps --sessions 1   # the writer's CPU per call, by step
    python bench/storage_bytes.py --db postgres --index-floor   # the search index beside its floor
    python bench/storage_bytes.py --screenshots            # 30 turns of 200 KB screenshots

The run has the shape of the agentic replay (bench/agentic.py): ``--sessions`` sessions of
``--turns`` turns sharing a ``--system``-token system prompt; each turn adds a tool result
of ``--tool`` tokens and a streamed completion of ``--out`` tokens with logprobs. A token's
text is `` w<id>``, ids are random below 151,000. Each call is stored as the proxy stores
it: the request JSON as the client sent it (the whole conversation), the reassembled
response with its logprobs, the engine's prompt ids, the completion's ids and logprobs.
Records go through ``storage.rows.insert_calls`` with the writer's cache, a turn of every
session per transaction (the writer's batches), into a freshly migrated database.

``--layout inline`` writes the same records as revision 0005 stored them (prompt ids and
bodies inline in every call): the "before" figure. Printed per database: bytes the run
added (SQLite: the file after a WAL checkpoint; Postgres: ``pg_total_relation_size`` of
every table, TOAST and indexes included), bytes per unique token, and the token ids
stored (prompt blocks once each, or inline prompt ids, plus completion ids) per unique
token. Unique tokens: the system prompt once, plus every tool result and completion.
Of those bytes, the viewer's search index (``call_text`` with its indexes, and SQLite's
FTS5 tables: storage.search_index) is printed apart; ``--search-index off`` writes the
calls as ``--no-search-index`` does (no index rows).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import asyncpg
from pgtemp import create_database, drop_database

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tracetap.migrations import upgrade  # noqa: E402
from tracetap.proxy.apis.registry import readers  # noqa: E402
from tracetap.storage.dedup import BlockCache  # noqa: E402
from tracetap.storage.engine import create_engine  # noqa: E402
from tracetap.storage.footprint import stored_ids  # noqa: E402
from tracetap.storage.records import CallRecord, ChoiceRecord  # noqa: E402
from tracetap.storage.rows import call_row, episode_rows, insert_calls  # noqa: E402
from tracetap.storage.tables import Call, Choice, Episode  # noqa: E402

READERS = readers()  # where each API's requests hold their messages, as the proxy has it

VOCAB = 151_000


def _ids(rnd: random.Random, n: int) -> list[int]:
    return [rnd.randrange(1000, VOCAB) for _ in range(n)]


def _text(ids: list[int]) -> str:
    return "".join(f" w{t}" for t in ids)


def _encode(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def records(args: argparse.Namespace) -> list[list[CallRecord]]:
    """Per turn, one record per session (a turn of every session is one batch)."""
    system = _ids(random.Random(0), args.system)
    head = {"model": "agentic-model", "stream": True, "max_tokens": args.out,
            "logprobs": True, "top_logprobs": 0, "stream_options": {"include_usage": True}}
    sessions = []
    for s in range(args.sessions):
        rnd = random.Random(s + 1)
        sessions.append({"rnd": rnd, "ids": list(system),
                         "messages": [{"role": "system", "content": _text(system)}]})
    batches, now = [], time.time()
    for turn in range(args.turns):
        batch = []
        for s, state in enumerate(sessions):
            rnd = state["rnd"]
            tool = _ids(rnd, args.tool)
            state["messages"].append({"role": "user", "content": f"[s={s} t={turn}]" + _text(tool)})
            state["ids"] += tool
            out = _ids(rnd, args.out)
            logprobs = [-round(rnd.random() * 4, 6) for _ in out]
            text = _text(out)
            response = {"id": f"chatcmpl-{s}-{turn}", "object": "chat.completion",
                        "created": 1_700_000_000, "model": "agentic-model",
                        "choices": [{"index": 0,
                                     "message": {"role": "assistant", "content": text},
                                     "logprobs": {"content": [
                                         {"token": f" w{t}", "logprob": lp}
                                         for t, lp in zip(out, logprobs)]},
                                     "finish_reason": "length"}],
                        "usage": {"prompt_tokens": len(state["ids"]),
                                  "completion_tokens": len(out)}}
            batch.append(CallRecord(
                call_id=f"call-{s:03d}-{turn:04d}", episode_id=f"session-{s}", seq=turn,
                endpoint="chat.completions", model="agentic-model", stream=True,
                request=_encode({**head, "messages": state["messages"]}),
                response=_encode(response), http_status=200, t_start=now + turn,
                t_end=now + turn + 1, prompt_tokens=len(state["ids"]),
                completion_tokens=len(out), prompt_ids=list(state["ids"]),
                choices=[ChoiceRecord(index=0, finish_reason="length", text=text,
                                      completion_ids=out, completion_logprobs=logprobs,
                                      token_source="engine")]))
            state["messages"].append({"role": "assistant", "content": text})
            state["ids"] += out
        batches.append(batch)
    return batches


async def _inline(engine, batch: list[CallRecord]) -> None:
    """The records as revision 0005 stored them: every call's prompt and bodies inline."""
    from tracetap.storage.rows import choice_rows, insert_ignoring_duplicates

    dialect = engine.dialect.name
    async with engine.begin() as conn:
        await conn.execute(insert_ignoring_duplicates(dialect, Episode.__table__),
                           episode_rows(batch))
        await conn.execute(insert_ignoring_duplicates(dialect, Call.__table__),
                           [call_row(r, time.time()) for r in batch])
        await conn.execute(insert_ignoring_duplicates(dialect, Choice.__table__),
                           [row for r in batch for row in choice_rows(r)])


async def store(url: str, batches: list[list[CallRecord]], layout: str,
                search_index: bool = True) -> float:
    engine = create_engine(url)
    cache = BlockCache()
    started = time.perf_counter()
    try:
        for batch in batches:
            if layout == "inline":
                await _inline(engine, batch)
            else:
                await insert_calls(engine, batch, cache, search_index=search_index,
                                   readers=READERS)
    finally:
        await engine.dispose()
    return time.perf_counter() - started


# The search index's share: call_text (its rows, unique and episode indexes, TOAST) and
# SQLite's FTS5 shadow tables (call_text_fts_data, _idx, _config).
_SQLITE_INDEX_SIZE = ("SELECT coalesce(sum(pgsize), 0) FROM dbstat WHERE name LIKE 'call_text%' "
                      "OR name LIKE 'ix_call_text%' OR name LIKE 'sqlite_autoindex_call_text%'")
_PG_INDEX_SIZE = "SELECT pg_total_relation_size('call_text')"
_PG_SIZE = ("SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'public' AND c.relkind = 'r'")
def size(url: str) -> tuple[int, int, int]:
    """(bytes, stored token ids, bytes of the search index) of the database at ``url``."""
    ids = asyncio.run(_stored(url))
    if url.startswith("sqlite"):
        path = Path(url.removeprefix("sqlite:///"))
        with sqlite3.connect(path) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            index = conn.execute(_SQLITE_INDEX_SIZE).fetchone()[0]
        return path.stat().st_size, ids, index

    async def pg():
        conn = await asyncpg.connect(url)
        try:
            return int(await conn.fetchval(_PG_SIZE)), int(await conn.fetchval(_PG_INDEX_SIZE))
        finally:
            await conn.close()

    total, index = asyncio.run(pg())
    return total, ids, index


async def _stored(url: str) -> int:
    engine = create_engine(url)
    try:
        return (await stored_ids(engine)).total
    finally:
        await engine.dispose()


def measure(db: str, batches, args, folder: Path) -> dict:
    name = f"{db}-{args.layout}-{args.search_index}.db"
    url = f"sqlite:///{folder / name}" if db == "sqlite" else create_database()
    try:
        upgrade(url)
        empty, _, empty_index = size(url)
        seconds = asyncio.run(store(url, batches, args.layout, args.search_index == "on"))
        full, ids, index = size(url)
    finally:
        if db == "postgres":
            drop_database(url)
    unique = args.system + args.sessions * args.turns * (args.tool + args.out)
    return {"db": db, "layout": args.layout, "calls": sum(map(len, batches)),
            "unique_tokens": unique, "bytes": full - empty,
            "bytes_per_unique_token": round((full - empty) / unique, 2),
            "stored_ids_per_unique_token": round(ids / unique, 3),
            "search_index": args.search_index, "search_index_bytes": index - empty_index,
            "search_index_bytes_per_unique_token": round((index - empty_index) / unique, 2),
            "write_seconds": round(seconds, 2)}


def writer_cpu(batches) -> None:
    """The writer's planning CPU per call (storage.dedup.plan; CPU time, best of 5) by
    context, one session, its previous call remembered; beside it what the inline layout
    paid to pack the ids."""
    import timeit
    from functools import partial

    from tracetap.storage.codec import pack_ids
    from tracetap.storage.dedup import plan

    cache = BlockCache()
    for turn, batch in enumerate(batches):
        record = batch[0]
        last = cache.get(record.episode_id)
        parents = {record.episode_id: last} if last is not None else {}
        if turn % 10 == 9:
            planning, packing = (
                min(timeit.repeat(work, number=10, repeat=5, timer=time.process_time)) / 10
                for work in (partial(plan, [record], parents, READERS),
                             partial(pack_ids, record.prompt_ids)))
            print(json.dumps({"context_tokens": len(record.prompt_ids),
                              "plan_cpu_ms": round(planning * 1000, 2),
                              "inline_pack_ids_cpu_ms": round(packing * 1000, 2)}), flush=True)
        cache.commit(plan([record], parents, READERS))


def writer_steps(url: str, batches, rounds: int) -> dict:
    """Process CPU (every thread: aiosqlite runs SQLite in its own) of the writer's insert
    per batch, and of two of its steps: planning (``rows._plan``: the transaction's start
    and storage.dedup.plan) and the search index (``storage.search_index.index_calls``);
    the rest is the rows' statements and the commit. Records arrive with their prompt ids
    packed, as the proxy sends them. Per context bucket of the batches' first call, the
    median over batches of each run's per-batch minimum over ``rounds`` fresh databases."""
    import statistics

    from tracetap.storage import rows
    from tracetap.storage.codec import pack_ids

    for batch in batches:
        for record in batch:
            if record.prompt_ids is not None:
                record.prompt_ids_packed, record.prompt_ids = pack_ids(record.prompt_ids), None
    plan0, index0 = rows._plan, rows.index_calls
    spent: dict[str, float] = {}

    def timed(name, work):
        async def run(*a, **kw):
            began = time.process_time()
            try:
                return await work(*a, **kw)
            finally:
                spent[name] += time.process_time() - began
        return run

    rows._plan, rows.index_calls = timed("plan", plan0), timed("index", index0)
    runs = []
    try:
        for _ in range(rounds):
            target = url if url.startswith("sqlite") else create_database()
            try:
                upgrade(target)
                runs.append(asyncio.run(_steps(target, batches, spent)))
            finally:
                if not url.startswith("sqlite"):
                    drop_database(target)
                else:
                    Path(url.removeprefix("sqlite:///")).unlink()
    finally:
        rows._plan, rows.index_calls = plan0, index0
    best = [{k: min(run[i][k] for run in runs) for k in runs[0][i]} for i in range(len(batches))]
    out = {}
    for lo, hi in ((0, 10_000), (10_000, 30_000), (30_000, 60_000), (60_000, 10**9)):
        picked = [b for b in best if lo <= b["context"] < hi]
        if picked:
            out[f"{lo // 1000}k+"] = {k: round(statistics.median(b[k] for b in picked) * 1e3, 2)
                                      for k in ("all", "plan", "index", "rest")}
    return out


async def _steps(url: str, batches, spent: dict[str, float]) -> list[dict]:
    engine = create_engine(url)
    cache, out = BlockCache(), []
    try:
        for batch in batches:
            spent.update(plan=0.0, index=0.0)
            began = time.process_time()
            await insert_calls(engine, batch, cache, search_index=True, readers=READERS)
            total = time.process_time() - began
            out.append({"context": len(batch[0].prompt_ids_packed) // 4, "all": total,
                        **spent, "rest": total - spent["plan"] - spent["index"]})
    finally:
        await engine.dispose()
    return out


async def index_floor(url: str, unique: int) -> dict:
    """The Postgres search index of a stored run: its (call, word) pairs and distinct
    words, its parts' bytes as written and rebuilt (REINDEX, VACUUM FULL), and the least
    any exact word-to-calls index holds: per call, log2 C(distinct words, its words)."""
    from math import lgamma, log

    conn = await asyncpg.connect(url)
    try:
        per_call = [r[0] for r in await conn.fetch(
            "SELECT coalesce(array_length(string_to_array(words, ' '), 1), 0) FROM call_text")]
        distinct = await conn.fetchval(
            "SELECT count(DISTINCT w) FROM call_text, unnest(string_to_array(words, ' ')) w")

        async def parts() -> dict:
            sizes = await conn.fetchrow(
                "SELECT pg_relation_size('ix_call_text_word_keys') AS gin, "
                "pg_total_relation_size('call_text') AS total")
            return {k: round(v / unique, 2) for k, v in sizes.items()}
        written = await parts()
        await conn.execute("REINDEX TABLE call_text")
        await conn.execute("VACUUM FULL call_text")
        rebuilt = await parts()
    finally:
        await conn.close()
    bits = sum((lgamma(distinct + 1) - lgamma(k + 1) - lgamma(distinct - k + 1)) / log(2)
               for k in per_call)
    return {"calls": len(per_call), "pairs": sum(per_call), "distinct_words": distinct,
            "index_bytes_per_unique_token_written": written,
            "rebuilt": rebuilt, "floor_bytes_per_unique_token": round(bits / 8 / unique, 2)}


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The run's shape, as ``records`` reads it (bench/data_floor.py takes the same)."""
    for name, default in (("sessions", 8), ("turns", 30), ("tool", 2000), ("out", 400),
                          ("system", 1000)):
        parser.add_argument(f"--{name}", type=int, default=default)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser)
    parser.add_argument("--db", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--layout", choices=("blocks", "inline"), default="blocks",
                        help="blocks: as stored now; inline: as before revision 0007")
    parser.add_argument("--search-index", choices=("on", "off"), default="on",
                        help="off: store the calls as --no-search-index does")
    parser.add_argument("--writer-cpu", action="store_true",
                        help="print the writer's planning CPU per call instead")
    parser.add_argument("--writer-steps", action="store_true",
                        help="print the writer's CPU per batch by step and context instead "
                             "(ms, search index on; use with --sessions 1)")
    parser.add_argument("--rounds", type=int, default=3, help="fresh databases, --writer-steps")
    parser.add_argument("--index-floor", action="store_true",
                        help="Postgres: the search index's parts beside the least any exact "
                             "index of the same words holds")
    parser.add_argument("--screenshots", action="store_true",
                        help="a screenshot-heavy replay instead (bench/image_bytes.py)")
    args = parser.parse_args()
    if args.screenshots:
        from image_bytes import main as screenshots
        screenshots(["--db", args.db])
        return
    batches = records(args)
    if args.writer_cpu:
        writer_cpu(batches)
        return
    if args.writer_steps:
        with tempfile.TemporaryDirectory(prefix="tracetap-writer-steps-") as tmp:
            for db in ("sqlite", "postgres") if args.db == "both" else (args.db,):
                url = f"sqlite:///{Path(tmp) / 'steps.db'}" if db == "sqlite" else "postgres"
                print(json.dumps({"db": db, "cpu_ms_per_batch": writer_steps(
                    url, batches, args.rounds)}), flush=True)
        return
    if args.index_floor:
        url = create_database()
        try:
            upgrade(url)
            asyncio.run(store(url, batches, "blocks", True))
            unique = args.system + args.sessions * args.turns * (args.tool + args.out)
            print(json.dumps(asyncio.run(index_floor(url, unique))))
        finally:
            drop_database(url)
        return
    with tempfile.TemporaryDirectory(prefix="tracetap-storage-bytes-") as tmp:
        for db in ("sqlite", "postgres") if args.db == "both" else (args.db,):
            print(json.dumps(measure(db, batches, args, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
