"""One replica's CPU, measured: idle, per call, per stream, per token; HAProxy's share.

    python bench/replica_cpu.py                      # ~3 min on 2 cores
    python bench/replica_cpu.py --idle-seconds 60 --calls 2000

Starts the mock engine (``tracetap mock-engine``: it honours max_tokens), one
``tracetap serve`` replica on a fresh Postgres database (dropped at the end) and HAProxy
with the shipped deploy/haproxy/haproxy.cfg in front of it. CPU is each process's own
(utime + stime from /proc/<pid>/stat, children included for the replica), not wall time,
so a busy machine slows the run but hardly moves the figures. In order:

1. idle: the replica alone, no traffic, for --idle-seconds;
2. idle under HAProxy's health checks (/readyz and /readyz/admin every second each), and
   HAProxy's own idle cost;
3. --calls non-streamed calls (64 tokens), --concurrency at a time, through HAProxy;
4. --calls streams of --short-tokens and of --long-tokens tokens, through HAProxy. The cost
   of a stream is a + b * tokens: b is the cost per token, a the cost per stream;
5. the replica's CPU per health check: GET /readyz and /readyz/admin, each on a new
   connection as HAProxy's checks are.

Postgres's CPU (the writer's inserts) is not in these figures: it runs in its own
processes, and docs/scaling.md gives the database's load per 1,000 calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from haproxy_lb import HAProxy
from pgtemp import create_database, drop_database
from proxy_bench import free_port, spawn, stop

from tracetap.migrations import upgrade

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process and its reaped children."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / TICK


async def wait_up(session: aiohttp.ClientSession, url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with session.get(url) as reply:
                if reply.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up")
        await asyncio.sleep(0.1)


async def idle(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Each process's share of a core over ``seconds`` of no traffic."""
    before, started = {n: cpu_seconds(p) for n, p in pids.items()}, time.monotonic()
    await asyncio.sleep(seconds)
    wall = time.monotonic() - started
    return {n: (cpu_seconds(p) - before[n]) / wall for n, p in pids.items()}


async def run_calls(session: aiohttp.ClientSession, url: str, calls: int, concurrency: int,
                    stream: bool, tokens: int) -> None:
    queue = iter(range(calls))

    async def worker(w: int) -> None:
        for i in queue:
            body = {"model": "mock-model", "max_tokens": tokens, "stream": stream,
                    "messages": [{"role": "user", "content": f"bench {w} {i}"}]}
            async with session.post(f"{url}/episodes/cpu-{w}/v1/chat/completions",
                                    json=body) as reply:
                assert reply.status == 200, await reply.text()
                await reply.read()

    await asyncio.gather(*(worker(w) for w in range(concurrency)))


async def per_call(session, url, pids, args, stream: bool, tokens: int) -> dict[str, float]:
    """CPU seconds per call of each process, over ``args.calls`` calls."""
    await run_calls(session, url, max(20, args.calls // 10), args.concurrency, stream, tokens)
    before = {n: cpu_seconds(p) for n, p in pids.items()}
    await run_calls(session, url, args.calls, args.concurrency, stream, tokens)
    return {n: (cpu_seconds(p) - before[n]) / args.calls for n, p in pids.items()}


async def per_check(port: int, pid: int, checks: int = 500) -> dict[str, float]:
    """CPU seconds of the replica per health check, a new connection each."""
    out = {}
    for path in ("/readyz", "/readyz/admin"):
        before = cpu_seconds(pid)
        for _ in range(checks):
            async with aiohttp.ClientSession() as session, session.get(
                    f"http://127.0.0.1:{port}{path}") as reply:
                await reply.read()
        out[path] = (cpu_seconds(pid) - before) / checks
    return out


async def measure(args, replica, lb: HAProxy) -> dict:
    pids = {"replica": replica.pid, "haproxy": lb.process.pid}
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await wait_up(session, f"{lb.url}/v1/models")
        out = {"idle_alone": None}
        out["idle_checked"] = await idle(pids, args.idle_seconds)
        out["call"] = await per_call(session, lb.url, pids, args, False, 64)
        out["stream_short"] = await per_call(session, lb.url, pids, args, True,
                                             args.short_tokens)
        out["stream_long"] = await per_call(session, lb.url, pids, args, True,
                                            args.long_tokens)
    out["check"] = await per_check(args.port, replica.pid)
    return out


def table(figures: dict, args) -> str:
    span = args.long_tokens - args.short_tokens
    rows = []
    for who in ("replica", "haproxy"):
        short, long_ = figures["stream_short"][who], figures["stream_long"][who]
        token = (long_ - short) / span
        stream = short - token * args.short_tokens
        rows.append((who, figures["idle_alone"].get(who), figures["idle_checked"][who],
                     figures["call"][who], stream, token))
    lines = [f"machine: {platform.machine()}, {os.cpu_count()} cores, "
             f"{_cpu_model()}; Python {platform.python_version()}",
             f"calls {args.calls} per figure, concurrency {args.concurrency}, "
             f"streams of {args.short_tokens} and {args.long_tokens} tokens",
             "",
             "| process | idle, no traffic | idle, HAProxy checking | per call (64 tokens) "
             "| per stream | per streamed token |",
             "| --- | --- | --- | --- | --- | --- |"]
    for who, alone, checked, call, stream, token in rows:
        shown = "-" if alone is None else f"{alone:.3%} of a core"
        lines.append(f"| {who} | {shown} | {checked:.3%} of a core | {call * 1e3:.3f} ms "
                     f"| {stream * 1e3:.3f} ms | {token * 1e6:.1f} µs |")
    lines.append("")
    lines += [f"replica CPU per health check {path}: {cost * 1e3:.3f} ms"
              for path, cost in figures["check"].items()]
    return "\n".join(lines)


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="also print the raw figures")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="tracetap-cpu-"))
    db = create_database()
    engine = replica = lb = None
    try:
        upgrade(db)
        engine_port, port = free_port(), free_port()
        engine = spawn(["-m", "tracetap", "mock-engine", "--port", str(engine_port)],
                       work / "engine.log")
        replica = spawn(["-m", "tracetap", "serve", "--upstream",
                         f"http://127.0.0.1:{engine_port}/v1", "--db", db, "--port", str(port),
                         "--data-dir", str(work / "data")], work / "replica.log")

        async def alone() -> dict[str, float]:
            async with aiohttp.ClientSession() as session:
                await wait_up(session, f"http://127.0.0.1:{port}/healthz")
            await asyncio.sleep(3)  # start-up work done (flavor, tokenizer probe)
            return await idle({"replica": replica.pid}, args.idle_seconds)

        idle_alone = asyncio.run(alone())
        args.port = port
        lb = HAProxy(work, {"r1": f"127.0.0.1:{port}"}).start()
        figures = asyncio.run(measure(args, replica, lb))
        figures["idle_alone"] = idle_alone
        print(table(figures, args))
        if args.json:
            print(json.dumps(figures, indent=2))
    finally:
        if lb is not None:
            lb.stop()
        stop(replica)
        stop(engine)
        drop_database(db)
    return 0


if __name__ == "__main__":
    sys.exit(main())
