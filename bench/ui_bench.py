"""Trace viewer benchmark: the episodes page over 100,000 episodes in Postgres, and an
episode of 200 calls whose merged trajectory holds 200,000 tokens.

    python bench/ui_bench.py                        # 100,000 episodes, ~2 min on 2 cores
    python bench/ui_bench.py --episodes 5000 --rounds 5 --big-calls 20   # a quick run

1. Creates a fresh Postgres database (bench/pgtemp.py), migrates it, and fills it with
   COPY: --episodes episodes (groups of 8, rewards, outcomes, 1% with a failed call),
   3 calls each with small token arrays.
2. Adds one episode of --big-calls append-only calls: each call's prompt is the previous
   prompt + completion + an observation, so the one trajectory ends at --big-tokens; and
   the long agentic episode of demo.long_episode (30 turns, 65,000 tokens, its last call
   sending 60 messages), whose page is measured first, as the process's first request,
   with its size as sent (compressed) and as HTML.
3. Serves the viewer alone (as ``tracetap ui`` does, with the mock engine answering
   /detokenize) and times HTTP requests from a client in this process: each page
   --rounds times after one warm-up request; p50, p95 and max in milliseconds.

Targets: the episodes page under 200 ms; the big episode's first open under
500 ms and each later window under 150 ms at low load; the long episode's first open
under 500 ms and its page at most 60 KB as sent. ``cpu1st``/``cpu``: this
process's CPU per request (viewer, client, mock engine), which load does not inflate.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import random
import statistics
import sys
import time
from array import array
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import aiohttp  # noqa: E402
import asyncpg  # noqa: E402
from aiohttp import web  # noqa: E402
from pgtemp import create_database, drop_database  # noqa: E402

from tracetap.demo.engine import EngineConfig, EngineServer  # noqa: E402
from tracetap.demo.long_episode import long_episode  # noqa: E402
from tracetap.migrations import upgrade  # noqa: E402
from tracetap.proxy.apis.registry import readers  # noqa: E402
from tracetap.storage.engine import create_engine  # noqa: E402
from tracetap.storage.records import CallRecord, ChoiceRecord  # noqa: E402
from tracetap.storage.rows import insert_calls  # noqa: E402
from tracetap.viewer import PREFIX  # noqa: E402
from tracetap.viewer.access import Access  # noqa: E402
from tracetap.viewer.app import ViewerConfig, build_viewer  # noqa: E402

TOKEN = "bench-token"
LONG = "long-30"  # demo.long_episode's episode
T0 = 1_760_000_000.0
OUTCOMES = ("solved", "partial", "failed")


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--big-calls", type=int, default=200)
    parser.add_argument("--big-tokens", type=int, default=200_000,
                        help="tokens of the big episode's merged trajectory")
    parser.add_argument("--db", help="an existing, migrated Postgres URL to fill (kept)")
    return parser.parse_args()


async def fill_episodes(url: str, n: int) -> None:
    dsn = url.replace("postgresql+asyncpg://", "postgresql://")
    rng = random.Random(7)
    ids8 = array("i", range(8)).tobytes()
    lps8 = array("d", [-0.5] * 8).tobytes()
    episodes, calls, choices = [], [], []
    for i in range(n):
        eid = f"ep-{i:07d}"
        created = T0 + i * 3.0
        reward = rng.choice((0.0, 0.25, 0.5, 0.75, 1.0)) if i % 10 else None
        outcome = None if reward is None else OUTCOMES[0 if reward == 1 else
                                                       2 if reward == 0 else 1]
        episodes.append((eid, f"grp-{i // 8:06d}", f"task-{i % 500}", f"harness-{i % 4}",
                         None, None, None, True, created,
                         None if reward is None else created + 20.0, reward, None, outcome,
                         None))
        for k in range(3):
            cid = f"{i:08d}-{k}"
            failed = k == 2 and i % 100 == 0
            t = created + k * 5.0
            calls.append((cid, eid, k, "bench", "chat.completions", "m", None, False,
                           "http://engine/v1", None, None, "ok", 500 if failed else 200, None,
                           t, t + 0.05, t + 1.0 + (i % 7) * 0.1, 0.9, 8, 8, ids8, t + 1.1))
            if not failed:
                choices.append((cid, 0, "stop", "text", ids8, lps8, None, "engine"))
    conn = await asyncpg.connect(dsn)
    try:
        for table, rows in (("episodes", episodes), ("calls", calls), ("choices", choices)):
            columns = [r["column_name"] for r in await conn.fetch(
                "SELECT column_name FROM information_schema.columns WHERE table_name = $1 "
                "ORDER BY ordinal_position", table)]
            # Rows name the first columns; ones later migrations appended stay null.
            await conn.copy_records_to_table(table, records=rows,
                                             columns=columns[:len(rows[0])])
        await conn.execute("ANALYZE")
    finally:
        await conn.close()


async def fill_big_episode(url: str, calls: int, total: int) -> str:
    """One episode whose trajectory grows to ``total`` tokens over ``calls`` calls."""
    step = total // calls
    completion_n, observation_n = step // 2, step - step // 2
    rng = random.Random(11)
    context = [rng.randrange(256) for _ in range(observation_n)]
    records = []
    for k in range(calls):
        completion = [rng.randrange(256) for _ in range(completion_n)]
        t = T0 + 10_000_000 + k * 2.0
        records.append(CallRecord(
            call_id=f"big-{k:04d}", episode_id="big", seq=k, instance="bench",
            endpoint="chat.completions", t_start=t, t_first_byte=t + 0.1, t_end=t + 1.0,
            status="ok", http_status=200, prompt_ids=list(context),
            prompt_tokens=len(context), completion_tokens=completion_n,
            request='{"messages": []}', response="{}", choices=[ChoiceRecord(
                index=0, finish_reason="stop", text="x", completion_ids=completion,
                completion_logprobs=[-0.1] * completion_n, token_source="engine")]))
        context += completion + [rng.randrange(256) for _ in range(observation_n)]
    engine = create_engine(url)
    try:
        for start in range(0, len(records), 10):
            await insert_calls(engine, records[start:start + 10], readers=readers())
        await insert_calls(engine, long_episode(LONG), readers=readers())
    finally:
        await engine.dispose()
    return "big"


async def sizes(base: str, path: str) -> tuple[int, int]:
    """(bytes sent with Accept-Encoding: gzip, bytes of HTML) of one page."""
    headers = {"Authorization": f"Bearer {TOKEN}", "Accept-Encoding": "gzip"}
    async with (aiohttp.ClientSession(auto_decompress=False, headers=headers) as session,
                session.get(base + path) as reply):
        sent = await reply.read()
        gzipped = reply.headers.get("Content-Encoding") == "gzip"
    return len(sent), len(gzip.decompress(sent) if gzipped else sent)


async def timed(session: aiohttp.ClientSession, url: str, rounds: int) -> dict:
    async def once() -> float:
        started = time.perf_counter()
        async with session.get(url) as reply:
            await reply.read()
            if reply.status != 200:
                raise RuntimeError(f"{url} answered {reply.status}")
        return (time.perf_counter() - started) * 1000

    cpu = time.process_time()
    first = await once()  # warm-up, reported on its own (cold caches)
    first_cpu = (time.process_time() - cpu) * 1000
    cpu = time.process_time()
    samples = sorted([await once() for _ in range(rounds)])
    # CPU of this process (viewer, client and mock engine) per request: what the load
    # on a shared machine does not inflate; the database's time is in wall time only.
    return {"first": first, "p50": statistics.median(samples),
            "p95": samples[min(len(samples) - 1, int(0.95 * len(samples)))],
            "max": samples[-1], "first_cpu": first_cpu,
            "cpu": (time.process_time() - cpu) * 1000 / max(rounds, 1)}


async def measure(url: str, args: argparse.Namespace) -> dict:
    engine = EngineServer(EngineConfig(model="m"))
    await engine.start()
    app = build_viewer(ViewerConfig(database_url=url, detokenize_url=engine.url),
                       Access(lambda _request: TOKEN), readers(), mounted=False)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    base = f"http://127.0.0.1:{port}{PREFIX}"
    last_page = max(1, args.episodes // 50)
    pages = {
        "long episode (30 turns, 65k tokens)": f"/episodes/{LONG}",  # the first request
        "episodes: newest first": "/",
        "episodes: search id": "/?q=0012345",
        "episodes: group": "/?group=grp-000123",
        "episodes: failed, finished": "/?outcome=failed&finished=yes",
        "episodes: reward 0.25-0.75, by reward": "/?reward_min=0.25&reward_max=0.75&sort=reward",
        "episodes: some calls failed": "/?status=errors",
        "episodes: task + harness": "/?task=task-7&harness=harness-3",
        f"episodes: page {last_page} (offset)": f"/?page={last_page}",
        "groups": "/groups",
        "charts (2,000 newest)": "/charts.svg",
        f"big episode: first window ({args.big_calls} calls)": "/episodes/big",
        "big episode: every call listed": "/episodes/big?calls=all",
        "big episode: last window": f"/episodes/big?at={args.big_tokens - 100}",
        "big episode: 8,192-token window": "/episodes/big?n=8192&at=100000",
        "a call of the big episode": f"/calls/big-{args.big_calls - 1:04d}",
    }
    results = {}
    try:
        async with aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {TOKEN}"}) as session:
            for name, path in pages.items():
                results[name] = await timed(session, base + path, args.rounds)
        for name, path in (("long", f"/episodes/{LONG}"), ("big", "/episodes/big")):
            results[name + " bytes"] = await sizes(base, path)
    finally:
        await runner.cleanup()
        await engine.close()
    return results


def main() -> int:
    args = _arguments()
    url = args.db or create_database()
    try:
        if not args.db:
            upgrade(url)
        started = time.perf_counter()
        asyncio.run(fill_episodes(url, args.episodes))
        filled = time.perf_counter() - started
        asyncio.run(fill_big_episode(url, args.big_calls, args.big_tokens))
        print(f"filled {args.episodes:,} episodes ({3 * args.episodes:,} calls) in {filled:.1f}s, "
              f"plus one episode of {args.big_calls} calls / {args.big_tokens:,} tokens\n")
        results = asyncio.run(measure(url, args))
    finally:
        if not args.db:
            drop_database(url)
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'page':<44} {'first':>8} {'p50':>8} {'p95':>8} {'max':>8} {'cpu1st':>8} {'cpu':>6}"
          f"   (ms, {args.rounds} rounds)")
    for name, r in results.items():
        if name.endswith(" bytes"):
            continue
        print(f"{name:<44} {r['first']:>8.1f} {r['p50']:>8.1f} {r['p95']:>8.1f} {r['max']:>8.1f}"
              f" {r['first_cpu']:>8.1f} {r['cpu']:>6.1f}")
    episodes_p95 = max(r["p95"] for n, r in results.items() if n.startswith("episodes"))
    big_p95 = max(r["p95"] for n, r in results.items() if n.startswith("big episode"))
    big_first = results[next(n for n in results if n.startswith("big episode: first"))]["first"]
    print(f"\nepisodes pages: worst p95 {episodes_p95:.0f} ms (target < 200 ms)")
    print(f"big episode: worst p95 {big_p95:.0f} ms, first open {big_first:.0f} ms "
          "(targets: first open < 500 ms, later windows < 150 ms at low load)")
    long = results["long episode (30 turns, 65k tokens)"]
    sent, html = results["long bytes"]
    print(f"long episode: first open {long['first']:.0f} ms ({long['first_cpu']:.0f} ms CPU), "
          f"p95 {long['p95']:.0f} ms; page {sent / 1000:.1f} KB as sent "
          f"({html / 1000:.1f} KB of HTML) (targets: first open < 500 ms, at most 60 KB)")
    print(json.dumps({"episodes": args.episodes, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
