"""Search benchmark: the viewer's /search page over 100,000 episodes (300,000 calls) in
Postgres, through HTTP as a browser asks for it.

    python bench/search_bench.py                       # 100,000 episodes, ~3 min on 2 cores
    python bench/search_bench.py --episodes 5000 --rounds 5      # a quick run

1. A fresh Postgres database (bench/pgtemp.py), migrated; episodes and calls by COPY
   (bench/ui_bench.py's fill), then each episode gets a harness config
   (``{"context": full|summarised, "retries": 0-3}``), metadata (``{"batch": a|b|c}``) and
   its calls a policy version (v0-v9); each call a user message of 40 words drawn from a
   Zipf vocabulary of 5,000 (so one word is in most calls, others in a few), 1% of them
   with a rare error line, in its stored request (the snippets recompute the text from
   it), and a ``call_text`` row with the text's document (its words), as the writer
   writes it. The GIN index is maintained as rows arrive, as in use.
2. Serves the viewer alone and times each query --rounds times after one warm-up:
   p50, p95 and max in milliseconds. The load average is printed with the figures.

3. The worst a person can type (WORST: a common word 64 times, 63 different common words,
   the most words a search takes): each answers or is refused, within 2 s; the status
   (200, 400 too many words, 422 stopped at the time bound) and the time are printed.

Target: every query under 300 ms p95; every WORST one answered or refused within 2 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import aiohttp  # noqa: E402
import asyncpg  # noqa: E402
from aiohttp import web  # noqa: E402
from pgtemp import create_database, drop_database  # noqa: E402
from ui_bench import TOKEN, fill_episodes, timed  # noqa: E402

from tracetap.migrations import upgrade  # noqa: E402
from tracetap.proxy.apis.registry import readers  # noqa: E402
from tracetap.viewer import PREFIX  # noqa: E402
from tracetap.viewer.access import Access  # noqa: E402
from tracetap.viewer.app import ViewerConfig, build_viewer  # noqa: E402

WORDS = 5000
QUERIES = {
    "common word (most calls)": "?q=w0",
    "common word, page 5": "?q=w0&page=5",
    "mid word (~1% of calls)": "?q=w300",
    "rare word (a few calls)": "?q=w4990",
    "error line (1% of calls)": "?q=ConnectionResetError",
    "phrase": '?q="w1 w2"',
    "two words": "?q=w5+w40",
    "common word, not a rarer one": "?q=w7+-w300",
    "common, not commoner (~0 results)": "?q=w7+-w0",
    "no match": "?q=nosuchword",
    "word + model": "?q=w20&model=m",
    "word + policy": "?q=w20&policy=v3",
    "word + config factor": "?q=w20&where=config.context%3Dsummarised",
    "config factors only": "?where=config.context%3Dfull,config.retries%3D2",
    "metadata only": "?where=meta.batch%3Dc",
    "policy only": "?policy=v7",
    "word + harness + outcome": "?q=w50&harness=harness-1&outcome=failed",
}
_TERMS, _WORDS = 8, 16  # storage.search.MAX_TERMS, MAX_WORDS
WORST = {
    "a common word 64 times": "?q=" + "+".join(["w0"] * 64),
    "63 common words": "?q=" + "+".join(f"w{k}" for k in range(63)),
    f"{_TERMS + 1} common words": "?q=" + "+".join(f"w{k}" for k in range(_TERMS + 1)),
    f"{_TERMS} common words": "?q=" + "+".join(f"w{k}" for k in range(_TERMS)),
    f"{_TERMS} common words + config factor": "?q=" + "+".join(
        f"w{k}" for k in range(_TERMS)) + "&where=config.context%3Dsummarised",
    f"a rare word, not {_TERMS - 1} common ones": "?q=w4990+" + "+".join(
        f"-w{k}" for k in range(_TERMS - 1)),
    f"{_WORDS} common words in {_TERMS} phrases": "?q=" + "+".join(
        f"%22w{k}+w{k + _TERMS}%22" for k in range(_TERMS)),
    f"{_WORDS} common words, one phrase": "?q=%22" + "+".join(
        f"w{k}" for k in range(_WORDS)) + "%22",
}


async def worst(session: aiohttp.ClientSession, url: str, rounds: int) -> dict:
    """Each request's status and milliseconds (the slowest of ``rounds``)."""
    statuses, times = set(), []
    for _ in range(rounds):
        started = time.perf_counter()
        async with session.get(url) as reply:
            await reply.read()
            statuses.add(reply.status)
        times.append((time.perf_counter() - started) * 1000)
    return {"status": sorted(statuses), "max": max(times), "p50": sorted(times)[len(times) // 2]}


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--db", help="a database this bench filled before (kept): measure only")
    parser.add_argument("--keep", action="store_true",
                        help="keep the database it fills (its URL is printed) for --db")
    return parser.parse_args()


def _zipf_words(rng: random.Random, n: int) -> list[str]:
    weights = [1 / (k + 1) for k in range(WORDS)]
    return [f"w{k}" for k in rng.choices(range(WORDS), weights=weights, k=n)]


async def fill_search(url: str, episodes: int) -> None:
    dsn = url.replace("postgresql+asyncpg://", "postgresql://")
    conn = await asyncpg.connect(dsn)
    rng = random.Random(5)
    try:
        await conn.execute(
            "UPDATE episodes SET harness_config = json_build_object("
            "'context', CASE WHEN right(id, 1) < '5' THEN 'full' ELSE 'summarised' END, "
            "'retries', (right(id, 2)::int % 4))::text, "
            "metadata = json_build_object('batch', chr(97 + right(id, 1)::int % 3))::text")
        await conn.execute("UPDATE calls SET policy_version = 'v' || (right(episode_id, 1))")
        ids = await conn.fetch("SELECT call_id, episode_id FROM calls ORDER BY call_id")
        words = _zipf_words(rng, 40 * len(ids))
        rows = []
        for n, (call_id, episode_id) in enumerate(ids):
            body = " ".join(words[40 * n:40 * n + 40])
            if n % 100 == 7:
                body += "\nConnectionResetError: [Errno 104] Connection reset by peer"
            rows.append((call_id, episode_id, body))
        await conn.execute("CREATE TEMPORARY TABLE bench_text "
                           "(call_id text PRIMARY KEY, episode_id text, body text)")
        for start in range(0, len(rows), 50_000):
            await conn.copy_records_to_table("bench_text", records=rows[start:start + 50_000])
        await conn.execute(
            "UPDATE calls SET request = json_build_object('model', 'm', 'messages', "
            "json_build_array(json_build_object('role', 'user', 'content', t.body)))::text "
            "FROM bench_text t WHERE calls.call_id = t.call_id")
        # The words the writer gives each row (storage.search_index.words); these texts
        # are plain lower-case words, which to_tsvector('simple') splits the same way.
        await conn.execute("INSERT INTO call_text (call_id, episode_id, words) "
                           "SELECT call_id, episode_id, array_to_string(tsvector_to_array("
                           "to_tsvector('simple', body)), ' ') FROM bench_text ORDER BY call_id")
        await conn.execute("ANALYZE")
    finally:
        await conn.close()


async def measure(url: str, rounds: int) -> dict:
    app = build_viewer(ViewerConfig(database_url=url), Access(lambda _request: TOKEN),
                       readers(), mounted=False)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    base = f"http://127.0.0.1:{port}{PREFIX}/search"
    results = {}
    try:
        async with aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {TOKEN}"}) as session:
            for name, query in QUERIES.items():
                results[name] = await timed(session, base + query, rounds)
            for name, query in WORST.items():
                results["worst: " + name] = await worst(session, base + query, max(3, rounds // 4))
    finally:
        await runner.cleanup()
    return results


def main() -> int:
    args = _arguments()
    url = args.db or create_database()
    try:
        if not args.db:
            upgrade(url)
            started = time.perf_counter()
            asyncio.run(fill_episodes(url, args.episodes))
            asyncio.run(fill_search(url, args.episodes))
            print(f"filled {args.episodes:,} episodes ({3 * args.episodes:,} calls, each with "
                  f"search text) in {time.perf_counter() - started:.1f}s")
        load_before = os.getloadavg()
        results = asyncio.run(measure(url, args.rounds))
        load_after = os.getloadavg()
    finally:
        if args.keep and not args.db:
            print(f"kept: --db {url}")
        elif not args.db:
            drop_database(url)
    print(f"load average (1, 5, 15 min) before {load_before[0]:.1f} {load_before[1]:.1f} "
          f"{load_before[2]:.1f}, after {load_after[0]:.1f} {load_after[1]:.1f} "
          f"{load_after[2]:.1f}; {os.cpu_count()} CPUs\n")
    print(f"{'search':<36} {'first':>8} {'p50':>8} {'p95':>8} {'max':>8} {'cpu':>6}"
          f"   (ms, {args.rounds} rounds; cpu: this process's per request)")
    for name, r in results.items():
        if name.startswith("worst: "):
            continue
        print(f"{name:<36} {r['first']:>8.1f} {r['p50']:>8.1f} {r['p95']:>8.1f} {r['max']:>8.1f}"
              f" {r['cpu']:>6.1f}")
    slowest = max(((k, v) for k, v in results.items() if "p95" in v), key=lambda kv: kv[1]["p95"])
    print(f"\nworst p95: {slowest[1]['p95']:.0f} ms ({slowest[0]}; target < 300 ms)\n")
    print(f"{'worst a person can type':<44} {'status':>8} {'p50':>8} {'max':>8}   (ms; target: "
          "answered or refused within 2,000)")
    for name, r in results.items():
        if name.startswith("worst: "):
            print(f"{name[7:]:<44} {'/'.join(map(str, r['status'])):>8} {r['p50']:>8.1f} "
                  f"{r['max']:>8.1f}")
    print(json.dumps({"episodes": args.episodes, "load": [load_before, load_after],
                      "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
