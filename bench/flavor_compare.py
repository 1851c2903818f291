"""Proxy CPU per call: an `openai`-flavour upstream beside a vLLM-flavour one, one run.

    python bench/flavor_compare.py                        # 500, 10k, 60k contexts; SQLite, Postgres
    python bench/flavor_compare.py --contexts 60000 --dbs sqlite --rounds 3
    python bench/flavor_compare.py --stream               # the client streams
    python bench/tokenize_cost.py --flavor-compare        # the same

One mock engine (``tracetap mock-engine``, vLLM flavour: it has ``/tokenize``) behind
proxies on fresh databases, two per database: one ``--upstream-flavor vllm`` (the engine
returns the ids it was asked for), one ``--upstream-flavor openai`` (ids not asked for:
the writer asks the engine's ``/tokenize`` for the prompt and the completion). Per
context, ``--concurrency`` agent sessions per proxy, each an episode that starts at that
context and adds a tool result and the model's reply each turn; rounds alternate the
proxies (the order rotating), a proxy's block being ``--turns`` turns of every session at
once. A block's CPU is every thread of the proxy (/proc schedstat) from its first request
until its writer has stored every call (the database polled by this process); the figure
is the minimum over rounds of CPU per call. At the end the stored prompt and completion
ids of each openai-flavour episode are compared with the vLLM-flavour twin's (the same
requests, the same engine): they must be the same ids.
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
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import asyncpg
import uvloop
from agentic_load import cpu_ns
from pgtemp import create_database, drop_database
from proxy_bench import free_port, spawn, stop, wait_ready

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tracetap.migrations import upgrade  # noqa: E402
from tracetap.storage import queries  # noqa: E402
from tracetap.storage.engine import create_engine  # noqa: E402

FLAVORS = ("vllm", "openai")


@dataclass
class Proxy:
    db_kind: str
    flavor: str
    db: str
    origin: str = ""
    process: object = None
    calls: int = 0  # made so far
    samples: dict[int, list[float]] = field(default_factory=dict)  # context -> CPU/call

    @property
    def name(self) -> str:
        return f"{self.db_kind}-{self.flavor}"


def words(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of the mock's byte tokenizer: one a byte."""
    out, size = [], 0
    while size < tokens:
        word = f"w{rng.randrange(100_000)} "
        out.append(word)
        size += len(word)
    return "".join(out)[:tokens]


class Session:
    """One agent's episode: a system prompt of the context, then tool turns."""

    def __init__(self, context: int, index: int, tool: int, out: int, stream: bool):
        self.rng = random.Random(context * 1000 + index)
        self.tool, self.out, self.stream = tool, out, stream
        self.messages: list[dict] = [{"role": "system", "content": words(self.rng, context)},
                                     {"role": "user", "content": "Fix the failing test."}]
        self.episode = f"ctx{context}-s{index}"

    def body(self) -> dict:
        return {"model": "mock-model", "messages": self.messages, "max_tokens": self.out,
                "mock_completion_tokens": self.out, "mock_tool_rounds": 0,
                "seed": len(self.messages), "stream": self.stream}

    def answered(self, content: str) -> None:
        self.messages.append({"role": "assistant", "content": content})
        self.messages.append({"role": "user", "content": words(self.rng, self.tool)})


async def stored(proxy: Proxy) -> int:
    if proxy.db.startswith("sqlite"):
        path = proxy.db.removeprefix("sqlite:///")
        with sqlite3.connect(path, timeout=30) as conn:
            return conn.execute("SELECT count(*) FROM calls").fetchone()[0]
    conn = await asyncpg.connect(proxy.db)
    try:
        return await conn.fetchval("SELECT count(*) FROM calls")
    finally:
        await conn.close()


async def block(http: aiohttp.ClientSession, proxy: Proxy, sessions: list[Session],
                turns: int) -> float:
    """CPU seconds per call of ``turns`` turns of every session at once, writes included."""
    async def run(session: Session) -> None:
        url = f"{proxy.origin}/episodes/{session.episode}/v1/chat/completions"
        for _ in range(turns):
            async with http.post(url, json=session.body()) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{proxy.name}: {resp.status} {await resp.text()}")
                session.answered(await _content(resp, session.stream))

    pid = proxy.process.pid
    before = cpu_ns([pid])
    await asyncio.gather(*(run(s) for s in sessions))
    proxy.calls += turns * len(sessions)
    deadline = time.monotonic() + 120
    while await stored(proxy) < proxy.calls:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proxy.name}: calls not stored after 120 s")
        await asyncio.sleep(0.05)
    return (cpu_ns([pid]) - before) / 1e9 / (turns * len(sessions))


async def _content(resp: aiohttp.ClientResponse, stream: bool) -> str:
    """The reply's text: the message's, or a stream's deltas joined."""
    if not stream:
        return (await resp.json())["choices"][0]["message"].get("content") or ""
    parts = []
    async for line in resp.content:
        if line.startswith(b"data: {"):
            delta = json.loads(line[6:])["choices"][0].get("delta") or {}
            parts.append(delta.get("content") or "")
    return "".join(parts)


async def same_ids(proxies: list[Proxy], episodes: list[str]) -> tuple[int, int]:
    """(calls compared, calls whose ids differ) between each database's two flavours."""
    compared = differ = 0
    for db_kind in {p.db_kind for p in proxies}:
        pair = {p.flavor: p for p in proxies if p.db_kind == db_kind}
        engines = {f: create_engine(p.db) for f, p in pair.items()}
        try:
            for episode in episodes:
                got = {}
                for flavor, engine in engines.items():
                    calls = sorted(await queries.calls_of(engine, episode),
                                   key=lambda c: c["seq"])
                    got[flavor] = [(c["prompt_ids"], [ch["completion_ids"]
                                                      for ch in c["choices"]]) for c in calls]
                for a, b in zip(got["vllm"], got["openai"], strict=True):
                    compared += 1
                    differ += a != b or a[0] is None
        finally:
            for engine in engines.values():
                await engine.dispose()
    return compared, differ


async def bench(proxies: list[Proxy], args: argparse.Namespace) -> None:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        episodes = []
        for context in args.contexts:
            sessions = {p.name: [Session(context, i, args.tool, args.out, args.stream)
                                 for i in range(args.concurrency)] for p in proxies}
            episodes += [s.episode for s in sessions[proxies[0].name]]
            for p in proxies:  # warm-up: the sessions' first turn (whole prompt decoded)
                await block(http, p, sessions[p.name], 1)
            for r in range(args.rounds):
                order = proxies[r % len(proxies):] + proxies[:r % len(proxies)]
                for p in order:
                    cpu = await block(http, p, sessions[p.name], args.turns)
                    p.samples.setdefault(context, []).append(cpu)
            print(f"context {context}: done", flush=True)
        compared, differ = await same_ids(proxies, episodes)
    report(proxies, args)
    print(f"ids: {compared} calls compared between the flavours, {differ} differ "
          "(or have no prompt ids)")


def report(proxies: list[Proxy], args: argparse.Namespace) -> None:
    print(f"\nproxy CPU per call (µs), min over {args.rounds} rounds, c={args.concurrency}, "
          f"+{args.tool} tokens a turn, {args.out} out{', streamed' if args.stream else ''}")
    print(f"{'context':>8} {'db':>7} {'vllm':>8} {'openai':>8} {'openai-vllm':>12}")
    for context in args.contexts:
        for db_kind in args.dbs:
            pair = {p.flavor: min(p.samples[context]) * 1e6 for p in proxies
                    if p.db_kind == db_kind}
            delta = pair["openai"] - pair["vllm"]
            print(f"{context:>8} {db_kind:>7} {pair['vllm']:>8.0f} {pair['openai']:>8.0f} "
                  f"{delta:>+8.0f} ({delta / pair['vllm']:+.0%})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[500, 10_000, 60_000])
    parser.add_argument("--dbs", nargs="+", choices=("sqlite", "pg"), default=["sqlite", "pg"])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--turns", type=int, default=3, help="turns a session makes a block")
    parser.add_argument("--tool", type=int, default=300, help="tokens a turn adds")
    parser.add_argument("--out", type=int, default=100, help="completion tokens a turn")
    parser.add_argument("--stream", action="store_true", help="the client streams")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="tracetap-flavors-"))
    engine_port = free_port()
    engine_origin = f"http://127.0.0.1:{engine_port}"
    engine = spawn(["-m", "tracetap", "mock-engine", "--port", str(engine_port),
                    "--flavor", "vllm"], work / "engine.log")
    proxies: list[Proxy] = []
    try:
        for db_kind in args.dbs:
            for flavor in FLAVORS:
                if db_kind == "pg":
                    db = create_database()
                else:
                    (work / flavor).mkdir()
                    db = f"sqlite:///{work / flavor / 'tracetap.db'}"
                upgrade(db)
                proxy = Proxy(db_kind, flavor, db)
                proxies.append(proxy)
                port = free_port()
                proxy.origin = f"http://127.0.0.1:{port}"
                log = work / f"{proxy.name}.log"
                proxy.process = spawn(["-m", "tracetap", "--log-level", "WARNING", "serve",
                                       "--upstream", engine_origin + "/v1", "--port", str(port),
                                       "--upstream-flavor", flavor, "--db", db,
                                       "--data-dir", str(work / proxy.name)], log)
        uvloop.run(_ready(engine, engine_origin, proxies, work))
        uvloop.run(bench(proxies, args))
    finally:
        for p in proxies:
            stop(p.process)
            if p.db_kind == "pg":
                drop_database(p.db)
        stop(engine)
        if args.keep_logs:
            print(f"logs in {work}")
    return 0


async def _ready(engine, engine_origin: str, proxies: list[Proxy], work: Path) -> None:
    async with aiohttp.ClientSession() as http:
        await wait_ready(http, engine_origin + "/v1/models", engine, work / "engine.log")
        for p in proxies:
            await wait_ready(http, p.origin + "/healthz", p.process, work / f"{p.name}.log")


if __name__ == "__main__":
    sys.exit(main())
