"""The agentic replay's load generator, in its own process so it never shares the
driver's (or the proxy's) interpreter: raw aiohttp, request bodies built before the clock
starts, replies hashed rather than parsed.

    python bench/agentic_load.py --base http://127.0.0.1:8000 --sessions 0 1 2 --mode concurrent

Prints one JSON object: per turn (session, turn, context, ttft, seconds, digest, ok, and
in ``single`` mode the proxy's CPU for that turn), the run's elapsed time, this process's
own CPU, and in ``concurrent`` mode the proxy's RSS sampled against the context tokens in
flight.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import resource
import sys
import time
from pathlib import Path

import aiohttp
from agentic_shape import MODEL, Session, Sizes, encode


def tree(pid: int) -> list[int]:
    """``pid`` and its living descendants (``serve --workers N``: the workers)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except (FileNotFoundError, ProcessLookupError):
        return []
    return [pid, *(p for child in children for p in tree(int(child)))]


def cpu_ns(pids: list[int]) -> int:
    """Nanoseconds on CPU of every thread of ``pids`` and their descendants (schedstat:
    nanosecond resolution, where /proc/<pid>/stat counts 10 ms ticks)."""
    return sum(own_ns(pid) for root in pids for pid in tree(root))


def own_ns(pid: int) -> int:
    """Nanoseconds on CPU of ``pid``'s own threads (not its descendants)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def minor_faults(pids: list[int]) -> int:
    """Minor page faults of ``pids`` and their descendants so far: each is a page touched
    for the first time, a few µs of CPU on a virtual machine (proxy/server/heap.py)."""
    total = 0
    for root in pids:
        for pid in tree(root):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            total += int(stat.rsplit(")", 1)[1].split()[7])  # minflt, the 10th field
    return total


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for root in pids:
        for pid in tree(root):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


class Conversation:
    """One session's request bodies, grown turn by turn as an agent's would be."""

    def __init__(self, session: Session, client: str):
        self.session = session
        extra = {"model": MODEL, "stream": True, "max_tokens": session.sizes.out}
        if client == "rl":
            extra |= {"logprobs": True, "top_logprobs": 0, "return_token_ids": True,
                      "stream_options": {"include_usage": True}}
        self.head = encode(extra)[:-1] + b',"messages":['
        self.tools = [encode(session.tool_message(t)) for t in range(session.sizes.turns)]
        self.answers = [encode(session.assistant_message(t))
                        for t in range(session.sizes.turns)]
        self.messages = bytearray(encode(session.system_message()))

    def body(self, turn: int) -> bytes:
        if turn:
            self.messages += b"," + self.answers[turn - 1]
        self.messages += b"," + self.tools[turn]
        return self.head + self.messages + b"]}"


class Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.sizes = Sizes(max(args.sessions) + 1, args.turns, args.tool, args.out, args.system)
        self.turns: list[dict] = []
        self.in_flight = 0  # context tokens of the requests now in flight
        self.samples: list[tuple[int, int]] = []  # (context tokens in flight, proxy RSS)
        self.idle_rate = 0.0  # the proxy's CPU seconds per second when no call is running

    def url(self, session: int) -> str:
        if self.args.episode_prefix:
            return (f"{self.args.base}/episodes/{self.args.episode_prefix}-{session}"
                    f"/v1/chat/completions")
        return f"{self.args.base}/v1/chat/completions"

    async def turn(self, http: aiohttp.ClientSession, conv: Conversation, turn: int) -> dict:
        session = conv.session.number
        body = conv.body(turn)
        context = self.sizes.context(turn)
        digest = hashlib.blake2b(digest_size=16)
        first = None
        tail = b""
        size = 0
        status = 0
        self.in_flight += context
        started = time.perf_counter()
        try:
            async with http.post(self.url(session), data=body,
                                 headers={"Content-Type": "application/json"}) as resp:
                status = resp.status
                async for data in resp.content.iter_any():
                    if first is None:
                        first = time.perf_counter()
                    digest.update(data)
                    size += len(data)
                    tail = (tail + data)[-32:]
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            print(f"turn {session}/{turn}: {exc!r}", file=sys.stderr)
        finally:
            self.in_flight -= context
        ended = time.perf_counter()
        return {"session": session, "turn": turn, "context": context,
                "ttft": None if first is None else first - started, "seconds": ended - started,
                "digest": digest.hexdigest(), "bytes": size,
                "ok": status == 200 and tail.endswith(b"data: [DONE]\n\n")}

    async def settle(self, pids: list[int]) -> int:
        """The proxy's CPU once its background work (the writer) for a turn is done."""
        now = cpu_ns(pids)
        for _ in range(50):
            await asyncio.sleep(0.02)
            later = cpu_ns(pids)
            if later - now < 200_000:  # under 0.2 ms in 20 ms: idle
                return later
            now = later
        return now

    async def single(self, http: aiohttp.ClientSession, convs: list[Conversation]) -> None:
        """Turns one at a time. A turn's CPU is the proxy's from just before it is sent to
        when the proxy is idle again (its writer done), less what the proxy spends idle
        (its periodic background work) over as long."""
        pids = self.args.pids
        if pids:
            start, began = await self.settle(pids), time.perf_counter()
            await asyncio.sleep(2.0)
            self.idle_rate = (cpu_ns(pids) - start) / 1e9 / (time.perf_counter() - began)
        for conv in convs:
            for t in range(self.sizes.turns):
                before = await self.settle(pids) if pids else 0
                faults = minor_faults(pids)
                began = time.perf_counter()
                row = await self.turn(http, conv, t)
                if pids:
                    spent = (await self.settle(pids) - before) / 1e9
                    row["cpu"] = spent - self.idle_rate * (time.perf_counter() - began)
                    row["faults"] = minor_faults(pids) - faults
                self.turns.append(row)

    async def concurrent(self, http: aiohttp.ClientSession, convs: list[Conversation]) -> None:
        async def one(conv: Conversation) -> None:
            for t in range(self.sizes.turns):
                self.turns.append(await self.turn(http, conv, t))

        sampler = asyncio.create_task(self.sample()) if self.args.pids else None
        await asyncio.gather(*(one(conv) for conv in convs))
        if sampler is not None:
            sampler.cancel()

    async def sample(self) -> None:
        while True:
            self.samples.append((self.in_flight, rss_bytes(self.args.pids)))
            await asyncio.sleep(0.05)


async def main_async(args: argparse.Namespace) -> dict:
    run = Run(args)
    convs = [Conversation(Session(run.sizes, n), args.client) for n in args.sessions]
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     auto_decompress=False) as http:
        rss0 = rss_bytes(args.pids) if args.pids else 0
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        proxy0 = cpu_ns(args.pids) if args.pids else 0
        started = time.perf_counter()
        await (run.single if args.mode == "single" else run.concurrent)(http, convs)
        elapsed = time.perf_counter() - started
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        proxy1 = cpu_ns(args.pids) if args.pids else 0
    return {"mode": args.mode, "elapsed": elapsed, "turns": run.turns,
            "loadgen_cpu": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
            "proxy_cpu": (proxy1 - proxy0) / 1e9, "rss_start": rss0, "samples": run.samples,
            "idle_rate": run.idle_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="origin, e.g. http://127.0.0.1:8000")
    parser.add_argument("--episode-prefix", default="",
                        help="tag calls by /episodes/<prefix>-<session>/v1 (tracetap)")
    parser.add_argument("--sessions", type=int, nargs="+", required=True)
    parser.add_argument("--mode", choices=("single", "concurrent"), default="concurrent")
    parser.add_argument("--client", choices=("plain", "rl"), default="plain")
    parser.add_argument("--pids", type=int, nargs="*", default=[],
                        help="the proxy's process: its CPU and RSS are read from /proc")
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--tool", type=int, default=2000)
    parser.add_argument("--out", type=int, default=400)
    parser.add_argument("--system", type=int, default=1000)
    args = parser.parse_args()
    import uvloop

    print(json.dumps(uvloop.run(main_async(args))))


if __name__ == "__main__":
    main()
