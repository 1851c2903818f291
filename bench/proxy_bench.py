"""Proxy benchmark: direct vs a bare aiohttp relay vs tracetap (Postgres, SQLite), one run.

    python bench/proxy_bench.py                  # ~1.5-2 min on 2 cores
    python bench/proxy_bench.py --rounds 3 --seconds 8 --requests 500
    python bench/proxy_bench.py --client rl      # the client asks for logprobs itself
    python bench/proxy_bench.py --api messages   # an Anthropic client, translated to chat
    python bench/proxy_bench.py --only tracetap-pg tracetap-pg-workers --workers 2
                                                 # one worker vs 2 (serve --workers 2)

Starts, each in its own process (uvloop everywhere): the fast upstream (bench/upstream.py),
the bare relay (bench/relay.py), ``tracetap serve`` on a fresh Postgres database
``tracetap_bench_<random>`` (dropped at the end) and ``tracetap serve`` on SQLite. The load
generator (bench/loadgen.py) runs in this process. c=1 runs go in short blocks per target,
the order rotating each block; c=32 runs go one target at a time, the order rotating each
round. Samples of all rounds are pooled. What each figure means: bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import uvloop
from idle_cpu import idle_all
from loadgen import Report, Target, drain, interleaved, saturate, warm_up
from pgtemp import create_database, drop_database
from report import print_report

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tracetap.migrations import upgrade  # noqa: E402

VARIANTS = ("tracetap-pg", "tracetap-sqlite", "tracetap-pg-workers")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACETAP_")}
    env["PYTHONPATH"] = str(ROOT)
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)


async def wait_ready(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen,
                     log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited early:\n{log.read_text()[-3000:]}")
        try:
            async with session.get(url) as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout}s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()  # SIGTERM: tracetap drains its writer
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def bench(targets: list[Target], upstream: Target, args: argparse.Namespace,
                logs: dict[str, Path]) -> None:
    reports = {t.name: Report() for t in targets}
    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     auto_decompress=False) as session:
        for t in [upstream, *targets]:
            if t.process is not None:
                health = "/healthz" if t.metrics else "/v1/models"
                await wait_ready(session, t.base + health, t.process, logs[t.name])
        reference: dict[tuple[str, bool], bytes] = {}
        for t in targets:
            await warm_up(session, t, reports[t.name], reference, args.client)
            if t.metrics:
                await drain(session, t, reports[t.name].sent)
                reports[t.name].rss_warm = t.rss_mib()
        if args.idle_seconds > 0:  # every proxy at once, none of them serving
            await asyncio.sleep(1.0)  # the warm-up's writes settle
            pids = {t.name: [t.process.pid] for t in targets if t.name != "direct"}
            for name, idle in (await asyncio.to_thread(idle_all, pids,
                                                       args.idle_seconds)).items():
                reports[name].idle_ms_s = idle
        for r in range(args.rounds):
            order = targets[r % len(targets):] + targets[: r % len(targets)]
            print(f"round {r + 1}/{args.rounds}: {', '.join(t.name for t in order)}",
                  flush=True)
            await interleaved(session, order, reports, "c1", False, args.requests, args.client)
            await interleaved(session, order, reports, "c1_stream", True, args.requests // 2,
                              args.client)
            for t in order:
                rep = reports[t.name]
                await saturate(session, t, upstream, rep, "c32", False, args.seconds,
                               args.client)
                await saturate(session, t, upstream, rep, "c32_stream", True,
                               args.seconds / 2, args.client)
        finals = {}
        for t in targets:
            if t.metrics:
                reports[t.name].rss_after = t.rss_mib()
                finals[t.name] = await drain(session, t, reports[t.name].sent)
    print_report(targets, reports, finals, args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0,
                        help="length of each c=32 run, per target and round (streams: half)")
    parser.add_argument("--requests", type=int, default=300,
                        help="requests of each c=1 run, per target and round (streams: half)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--idle-seconds", type=float, default=4.0,
                        help="each proxy's idle CPU is read this long after the warm-up")
    parser.add_argument("--client", choices=("plain", "rl"), default="plain",
                        help="plain: a black-box harness asking for nothing (tracetap injects "
                             "and strips logprobs, token ids, usage); rl: the client asks for "
                             "them itself (tracetap relays bytes untouched)")
    parser.add_argument("--api", choices=("chat", "responses", "messages"), default="chat",
                        help="the wire API tracetap's client speaks; Responses and Messages "
                             "are translated to chat for this chat-only upstream, so direct "
                             "and relay (chat) are the baseline for the translated path")
    parser.add_argument("--only", nargs="*", choices=VARIANTS,
                        help="tracetap variants to run (default: Postgres and SQLite, and "
                             "Postgres with --workers when it is above 1)")
    parser.add_argument("--workers", type=int, default=1,
                        help="also run tracetap-pg-workers: Postgres, serve --workers N")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="tracetap-bench-"))
    ports = {name: free_port() for name in ("upstream", "relay", *VARIANTS)}
    origin = f"http://127.0.0.1:{ports['upstream']}"
    logs = {name: work / f"{name}.log" for name in ports}
    upstream = Target("direct", origin)
    targets = [upstream, Target("relay", f"http://127.0.0.1:{ports['relay']}")]
    variants = args.only or ["tracetap-pg", "tracetap-sqlite",
                             *(["tracetap-pg-workers"] if args.workers > 1 else [])]
    pg_urls = []
    try:
        upstream.process = spawn([str(ROOT / "bench/upstream.py"), "--port",
                                  str(ports["upstream"])], logs["upstream"])
        logs["direct"] = logs["upstream"]
        targets[1].process = spawn([str(ROOT / "bench/relay.py"), "--port", str(ports["relay"]),
                                    "--upstream", origin], logs["relay"])
        for name in variants:
            workers = ["--workers", str(args.workers)] if name == "tracetap-pg-workers" else []
            if name.startswith("tracetap-pg"):
                pg_urls.append(create_database())
                db = pg_urls[-1]
            else:
                db = f"sqlite:///{work / 'sqlite' / 'tracetap.db'}"
                (work / "sqlite").mkdir()
            upgrade(db)
            target = Target(name, f"http://127.0.0.1:{ports[name]}", episode_path=True,
                            metrics=True, api=args.api)
            target.process = spawn(["-m", "tracetap", "--log-level", "WARNING", "serve",
                                    "--upstream", origin + "/v1", "--port", str(ports[name]),
                                    "--db", db, "--data-dir", str(work / name), *workers],
                                   logs[name])
            targets.append(target)
        uvloop.run(bench(targets, upstream, args, logs))
    finally:
        for t in reversed(targets):
            stop(t.process)
        for url in pg_urls:
            drop_database(url)
        if args.keep_logs:
            print(f"logs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
