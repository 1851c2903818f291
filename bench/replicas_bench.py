"""Replicas behind HAProxy: calls/s and streams/s for 1, 2 and 4 replicas, against direct.

    python bench/replicas_bench.py                    # ~2 min on 2 cores
    python bench/replicas_bench.py --seconds 6 --rounds 3

Starts the fast upstream (bench/upstream.py), four `tracetap serve` replicas on one fresh
Postgres database (dropped at the end), and three HAProxy processes running the shipped
deploy/haproxy/haproxy.cfg in front of the first 1, 2 and 4 replicas. Then, in rounds
with the order rotating: c=N non-streaming calls and c=N 64-token streams against the
upstream directly, one replica directly, and each HAProxy. Each agent worker is its own
episode (/episodes/bench-<w>/v1), so HAProxy spreads the workers over the replicas by
the episode hash. Medians over rounds are printed, and the ratio to direct and to one
replica without HAProxy. Afterwards the database's write load per 1,000 calls is read from
pg_stat_database (commits, inserted rows; this database only) and the WAL position
(cluster-wide: other users of the same Postgres add to it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

import aiohttp
import asyncpg
import uvloop
from haproxy_lb import HAProxy
from loadgen import Sample, Target, load, request_body, scrape
from pgtemp import PG_ADMIN, create_database, drop_database
from proxy_bench import ROOT, free_port, spawn, stop, wait_ready

from tracetap.migrations import upgrade

REPLICAS = 4
SIZES = (1, 2, 4)


async def db_counters(url: str) -> dict[str, float]:
    conn = await asyncpg.connect(PG_ADMIN)
    try:
        name = url.rsplit("/", 1)[1]
        row = await conn.fetchrow(
            "SELECT xact_commit, tup_inserted, tup_updated, tup_deleted,"
            " pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0') AS wal"
            " FROM pg_stat_database WHERE datname = $1", name)
        return {k: float(v) for k, v in row.items()}
    finally:
        await conn.close()


async def written(session: aiohttp.ClientSession, replicas: list[Target]) -> float:
    total = 0.0
    for r in replicas:
        total += (await scrape(session, r)).get("tracetap_records_total,outcome=written", 0)
    return total


async def settle(session: aiohttp.ClientSession, replicas: list[Target], sent: float) -> float:
    """Wait until every replica's writer has committed what was sent (or 60 s)."""
    for _ in range(300):
        done = await written(session, replicas)
        if done >= sent:
            return done
        await asyncio.sleep(0.2)
    return await written(session, replicas)


async def run(targets: list[Target], replicas: list[Target], args) -> None:
    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    rates: dict[tuple[str, bool], list[float]] = {}
    cpu: dict[str, list[float]] = {}
    lb_cpu: dict[tuple[str, bool], list[float]] = {}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for t in targets:
            body = request_body(False, "plain")
            warm = await load(session, t, body, False, 8, count=200)
            assert warm.errors == 0, f"{t.name}: {warm.errors} errors while warming up"
        for r in range(args.rounds):
            order = targets[r % len(targets):] + targets[: r % len(targets)]
            print(f"round {r + 1}/{args.rounds}: {', '.join(t.name for t in order)}", flush=True)
            for t in order:
                for stream in (False, True):
                    seconds = args.seconds / 2 if stream else args.seconds
                    before = sum(x.cpu_seconds() for x in replicas)
                    lb_before = t.cpu_seconds() if t.name.startswith("haproxy") else 0.0
                    sample: Sample = await load(session, t, request_body(stream, "plain"),
                                                stream, args.concurrency, seconds=seconds)
                    used = sum(x.cpu_seconds() for x in replicas) - before
                    if t.name.startswith("haproxy"):
                        lb_cpu.setdefault((t.name, stream), []).append(
                            (t.cpu_seconds() - lb_before) / max(sample.done, 1) * 1000)
                    if sample.errors:
                        print(f"  {t.name} stream={stream}: {sample.errors} errors", flush=True)
                        args.failures += sample.errors
                    rates.setdefault((t.name, stream), []).append(sample.done / sample.elapsed)
                    if not stream and t.name != "direct":
                        cpu.setdefault(t.name, []).append(used / max(sample.done, 1) * 1000)

        # The database's write load: a fixed number of calls through all replicas, then
        # wait until every record is committed, and read the counters around it.
        sent = await written(session, replicas)
        before = await db_counters(args.db)
        sample = await load(session, targets[-1], request_body(False, "plain"), False,
                            args.concurrency, seconds=args.seconds)
        done = await settle(session, replicas, sent + sample.done)
        after = await db_counters(args.db)
    print_report(targets, rates, cpu, args)
    for (name, stream), values in sorted(lb_cpu.items()):
        kind = "stream" if stream else "call"
        print(f"  {name}: HAProxy CPU {statistics.median(values):.3f} ms per {kind}")
    calls = done - sent
    if calls < sample.done:
        print(f"only {int(calls)} of {sample.done} calls were written", flush=True)
        args.failures += 1
    print(f"\ndatabase write load, {int(calls)} calls in {sample.elapsed:.1f} s "
          f"({calls / sample.elapsed:.0f} calls/s) through {targets[-1].name}:")
    for key, label in (("xact_commit", "commits"), ("tup_inserted", "rows inserted"),
                       ("tup_updated", "rows updated"), ("wal", "WAL bytes (cluster-wide)")):
        per = (after[key] - before[key]) / calls * 1000
        print(f"  {label} per 1,000 calls: {per:,.0f}")


def print_report(targets, rates, cpu, args) -> None:
    direct = {s: statistics.median(rates[("direct", s)]) for s in (False, True)}
    single = {s: statistics.median(rates[("replica-1-direct", s)]) for s in (False, True)}
    print(f"\nmedians of {args.rounds} rounds, c={args.concurrency}, 64 tokens, plain client")
    print("| target | replicas | calls/s | per replica | vs direct | vs 1 replica direct "
          "| streams/s | per replica | vs direct | vs 1 replica direct | replica CPU ms/call |")
    print("| --- " * 11 + "|")
    for t in targets:
        n = 0 if t.name == "direct" else (1 if t.name == "replica-1-direct"
                                          else int(t.name.split("-")[1]))
        cells = [t.name, str(n) if n else "-"]
        for s in (False, True):
            rate = statistics.median(rates[(t.name, s)])
            cells += [f"{rate:.0f}", f"{rate / n:.0f}" if n else "-",
                      f"{rate / direct[s]:.2f}", f"{rate / single[s]:.2f}"]
        cells.append(f"{statistics.median(cpu[t.name]):.2f}" if t.name in cpu else "-")
        print("| " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0,
                        help="length of each non-streaming run, per target and round "
                             "(streams: half)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64,
                        help="agent workers, one episode each")
    args = parser.parse_args(argv)
    args.failures = 0

    work = Path(tempfile.mkdtemp(prefix="tracetap-replicas-bench-"))
    upstream_port = free_port()
    origin = f"http://127.0.0.1:{upstream_port}"
    upstream = Target("direct", origin)
    replicas: list[Target] = []
    balancers: list[HAProxy] = []
    args.db = create_database()
    try:
        upgrade(args.db)
        upstream.process = spawn([str(ROOT / "bench/upstream.py"), "--port",
                                  str(upstream_port)], work / "upstream.log")
        for i in range(REPLICAS):
            port = free_port()
            r = Target(f"replica-{i + 1}", f"http://127.0.0.1:{port}", episode_path=True,
                       metrics=True)
            r.process = spawn(["-m", "tracetap", "--log-level", "WARNING", "serve",
                               "--upstream", origin + "/v1", "--port", str(port),
                               "--db", args.db, "--data-dir", str(work / r.name)],
                              work / f"{r.name}.log")
            replicas.append(r)

        async def ready() -> None:
            async with aiohttp.ClientSession() as session:
                await wait_ready(session, origin + "/v1/models", upstream.process,
                                 work / "upstream.log")
                for r in replicas:
                    await wait_ready(session, r.base + "/readyz", r.process,
                                     work / f"{r.name}.log")

        asyncio.run(ready())
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
              flush=True)
        targets = [upstream, Target("replica-1-direct", replicas[0].base, episode_path=True)]
        for n in SIZES:
            folder = work / f"haproxy-{n}"
            folder.mkdir()
            lb = HAProxy(folder, {r.name: r.base.removeprefix("http://")
                                  for r in replicas[:n]})
            balancers.append(lb.start())
            lb.wait_until(lambda lb=lb, n=n: len(lb.up()) == n)
            targets.append(Target(f"haproxy-{n}", lb.url, episode_path=True, process=lb.process))
        uvloop.run(run(targets, replicas, args))
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        for lb in balancers:
            lb.stop()
        for t in [*replicas, upstream]:
            stop(t.process)
        drop_database(args.db)
    return 1 if args.failures else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
