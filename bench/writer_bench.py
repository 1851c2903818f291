"""Writer benchmark: call records through storage.writer.Writer vs raw asyncpg COPY.

    python bench/writer_bench.py                       # 50,000 records, ~30 s
    python bench/writer_bench.py --records 20000 --rounds 2

Each round makes two fresh Postgres databases (``tracetap_bench_<random>``, migrated with
migrations.upgrade, dropped at the end). Into one, the records go through the real
Writer (journal in a temp dir, batches committed by its background task) as fast as a
producer can submit them; into the other, the same rows (built by storage/rows.py, so
the same columns and packing) go in with asyncpg ``copy_records_to_table`` in one
transaction. Records carry 256 prompt ids, 256 completion ids and 256 logprobs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import asyncpg
import msgspec
import uvloop
from pgtemp import create_database, drop_database

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tracetap.migrations import upgrade  # noqa: E402
from tracetap.proxy.apis.registry import readers  # noqa: E402
from tracetap.proxy.episodes.ids import uuid7  # noqa: E402
from tracetap.storage.engine import create_engine  # noqa: E402
from tracetap.storage.journal import Journal  # noqa: E402
from tracetap.storage.records import CallRecord, ChoiceRecord  # noqa: E402
from tracetap.storage.rows import call_row, choice_rows, episode_rows  # noqa: E402
from tracetap.storage.writer import Writer  # noqa: E402

TOKENS = 256


def make_records(count: int, episodes: int = 1000, variants: int = 64) -> list[CallRecord]:
    """Synthetic finished calls. Token arrays come from a pool so memory stays small;
    packing and encoding cost the same whether or not two records share a list."""
    rnd = random.Random(1)
    pool = [([rnd.randrange(151_000) for _ in range(TOKENS)],
             [rnd.randrange(151_000) for _ in range(TOKENS)],
             [-rnd.random() * 5 for _ in range(TOKENS)]) for _ in range(variants)]
    request = msgspec.json.encode({
        "model": "bench-model", "max_tokens": TOKENS,
        "messages": [{"role": "user", "content": "word " * 60}]}).decode()
    text = "token " * TOKENS
    response = msgspec.json.encode({
        "id": "chatcmpl-bench", "object": "chat.completion", "model": "bench-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": TOKENS, "completion_tokens": TOKENS}}).decode()
    now = time.time()
    records = []
    for i in range(count):
        prompt, completion, logprobs = pool[i % variants]
        records.append(CallRecord(
            call_id=uuid7(), episode_id=f"bench-{i % episodes}", seq=i // episodes,
            instance="bench", endpoint="chat.completions", model="bench-model", stream=False,
            upstream="http://127.0.0.1:8000/v1", request=request, response=response,
            http_status=200, t_start=now + i * 1e-4, t_first_byte=now + i * 1e-4 + 0.01,
            t_end=now + i * 1e-4 + 0.02, upstream_latency=0.019, prompt_tokens=TOKENS,
            completion_tokens=TOKENS, prompt_ids=prompt,
            choices=[ChoiceRecord(index=0, finish_reason="length", text=text,
                                  completion_ids=completion, completion_logprobs=logprobs,
                                  token_source="engine")],
        ))
    return records


async def through_writer(url: str, records: list[CallRecord], journal_dir: Path,
                         burst: int, search_index: bool = True) -> tuple[float, int, int]:
    """Submit every record (yielding to the loop every ``burst``), wait for the last commit.
    Returns (seconds, peak pending records, batches committed)."""
    engine = create_engine(url)
    batches = 0

    class Count:
        def records(self, outcome: str, count: int) -> None: ...

        def db_write(self, seconds: float, count: int) -> None:
            nonlocal batches
            batches += 1

    writer = Writer(engine, Journal(journal_dir, max_bytes=64 << 30), observer=Count(),
                    search_index=search_index, readers=readers())
    writer.start()
    peak = 0
    started = time.perf_counter()
    for i, record in enumerate(records, 1):
        writer.submit(record)
        if i % burst == 0:
            peak = max(peak, writer.pending)
            await asyncio.sleep(0)
    while writer.pending:
        await asyncio.sleep(0.005)
    elapsed = time.perf_counter() - started
    assert writer.dropped == 0
    await writer.close()
    await engine.dispose()
    return elapsed, peak, batches


def _columns(rows: list[dict]) -> tuple[list[str], list[tuple]]:
    columns = list(rows[0])
    return columns, [tuple(row[c] for c in columns) for row in rows]


async def through_copy(url: str, records: list[CallRecord]) -> tuple[float, float]:
    """The same rows by COPY in one transaction. Returns (total seconds, COPY-only seconds)."""
    conn = await asyncpg.connect(url)
    try:
        started = time.perf_counter()
        stored_at = time.time()
        tables = {
            "episodes": _columns(episode_rows(records)),
            "calls": _columns([call_row(r, stored_at) for r in records]),
            "choices": _columns([row for r in records for row in choice_rows(r)]),
        }
        built = time.perf_counter()
        async with conn.transaction():
            for table, (columns, rows) in tables.items():
                await conn.copy_records_to_table(table, records=rows, columns=columns)
        done = time.perf_counter()
    finally:
        await conn.close()
    return done - started, done - built


async def count_rows(url: str) -> tuple[int, int]:
    conn = await asyncpg.connect(url)
    try:
        return (await conn.fetchval("SELECT count(*) FROM calls"),
                await conn.fetchval("SELECT count(*) FROM choices"))
    finally:
        await conn.close()


def fresh_database() -> str:
    url = create_database()
    upgrade(url)
    return url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--burst", type=int, default=32,
                        help="records submitted between yields to the event loop")
    parser.add_argument("--no-search-index", action="store_true",
                        help="the writer as tracetap serve --no-search-index runs it: no "
                             "search rows (storage.search_index), for comparison")
    args = parser.parse_args(argv)
    records = make_records(args.records)
    size = len(msgspec.msgpack.encode(records[0]))
    print(f"{os.cpu_count()} cores; {args.records} records, {size} bytes each in the journal")
    print(f"{'round':>5}  {'writer rec/s':>12}  {'COPY rec/s':>10}  {'ratio':>5}  "
          f"{'COPY-only rec/s':>15}  {'peak queue':>10}  {'batches':>7}")
    urls: list[str] = []
    ratios = []
    try:
        for r in range(args.rounds):
            writer_url, copy_url = fresh_database(), fresh_database()
            urls += [writer_url, copy_url]
            with tempfile.TemporaryDirectory(prefix="tracetap-writer-bench-") as tmp:
                # Alternate which goes first, so neither always meets a cold server.
                cpu = time.process_time()
                if r % 2 == 0:
                    w, peak, batches = uvloop.run(
                        through_writer(writer_url, records, Path(tmp), args.burst,
                                       not args.no_search_index))
                    cpu = time.process_time() - cpu
                    total, copy_only = uvloop.run(through_copy(copy_url, records))
                else:
                    total, copy_only = uvloop.run(through_copy(copy_url, records))
                    cpu = time.process_time()
                    w, peak, batches = uvloop.run(
                        through_writer(writer_url, records, Path(tmp), args.burst,
                                       not args.no_search_index))
                    cpu = time.process_time() - cpu
            for url in (writer_url, copy_url):
                assert uvloop.run(count_rows(url)) == (args.records, args.records), url
            n = args.records
            ratios.append(total / w)
            print(f"{r + 1:>5}  {n / w:>12.0f}  {n / total:>10.0f}  {total / w:>5.2f}  "
                  f"{n / copy_only:>15.0f}  {peak:>10}  {batches:>7}  "
                  f"writer CPU {1e6 * cpu / n:.0f} us/record", flush=True)
    finally:
        for url in urls:
            drop_database(url)
    best = max(ratios)
    print(f"\nwriter / COPY (rows built by storage/rows.py, same run): best {best:.2f}, "
          f"worst {min(ratios):.2f}; target >= 0.5: {'PASS' if min(ratios) >= 0.5 else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
