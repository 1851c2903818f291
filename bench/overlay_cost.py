"""What an ``after_model`` overlay costs a streamed reply (docs/overlays.md, "Streaming
and latency"): time to first content and whole-reply time, plain vs held for the hook.

    python bench/overlay_cost.py              # ~15 s
    python bench/overlay_cost.py --calls 50 --chunk-delay-ms 5

The mock engine streams one reply, the same every call: a sentence of text, then a tool
call (byte-level tokens, one event per text token, ``--chunk-delay-ms`` between events).
Three episodes ask for it through one tracetap, in turns: without an overlay, with an
overlay whose ``after_model`` sees the whole reply (the stream is buffered to its end), and
with one that sees tool calls only (the text streams live, the rest is buffered). Both
overlays accept every reply at once, so the figures are the holding alone, not a hook's
own time or a re-sample. Everything runs in this process, on one event loop (engine,
proxy, client): compare the ratios, not the milliseconds, across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proxy_bench import free_port  # noqa: E402

from tracetap.demo.agent import TOOLS  # noqa: E402
from tracetap.demo.engine import EngineConfig, EngineServer  # noqa: E402
from tracetap.migrations import upgrade  # noqa: E402
from tracetap.proxy.runtime.settings import Settings  # noqa: E402
from tracetap.proxy.server.app import build_app  # noqa: E402

# Seed 1 and this prompt: the mock engine writes a sentence before its tool call.
BODY = {"model": "mock-model", "stream": True, "seed": 1, "tools": TOOLS,
        "messages": [{"role": "system", "content": "Answer."},
                     {"role": "user", "content": "What is it?"}]}
ADMIN_TOKEN = "bench-admin-token"
VARIANTS = {"plain": None, "after_model, whole reply": "whole",
            "after_model, tool calls only": "toolcalls"}


class Accept:
    """Accepts every reply at once: what remains is the cost of holding it."""

    async def after_model(self, reply, state):
        return None


class AcceptToolCalls(Accept):
    after_model_sees = "tool_calls"


def whole() -> Accept:
    return Accept()


def toolcalls() -> AcceptToolCalls:
    return AcceptToolCalls()


async def register(session: aiohttp.ClientSession, url: str, episode: str,
                   overlay: str | None) -> str:
    """The episode registered under its overlay (the operator's choice): its key."""
    async with session.post(url + "/tracetap/episodes", json={"id": episode, "overlay": overlay},
                            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as reply:
        assert reply.status == 201, await reply.text()
        return (await reply.json())["api_key"]


async def one_call(session: aiohttp.ClientSession, url: str,
                   key: str) -> tuple[float, float, bool]:
    """(first content s, whole reply s, whether a tool call came) for one streamed call."""
    headers = {"Authorization": f"Bearer {key}"}
    start = time.perf_counter()
    first, tool_call = None, False
    async with session.post(url + "/v1/chat/completions", json=BODY, headers=headers) as reply:
        assert reply.status == 200, await reply.text()
        async for line in reply.content:
            if first is None and line.startswith(b"data: {") and b'"content":"' in line \
                    and b'"content":""' not in line:
                first = time.perf_counter() - start
            tool_call = tool_call or b'"tool_calls"' in line
    return first, time.perf_counter() - start, tool_call


async def run(calls: int, chunk_delay: float, db: str,
              data_dir: str) -> dict[str, tuple[list[float], list[float]]]:
    async with EngineServer(EngineConfig(chunk_delay_s=chunk_delay)) as engine:
        port = free_port()
        settings = Settings(upstream=engine.url, db=db, data_dir=data_dir, port=port,
                            admin_token=ADMIN_TOKEN,
                            # This script is __main__: the loader imports it as such.
                            overlay=["whole=__main__:whole", "toolcalls=__main__:toolcalls"])
        runner = web.AppRunner(build_app(settings), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}"
        figures: dict[str, tuple[list[float], list[float]]] = {v: ([], []) for v in VARIANTS}
        try:
            async with aiohttp.ClientSession() as session:
                keys = {}
                for overlay in VARIANTS.values():  # warm-up, uncounted
                    warm = await register(session, url, f"warm-{overlay}", overlay)
                    await one_call(session, url, warm)
                    keys[overlay] = await register(session, url, f"bench-{overlay}", overlay)
                order = list(VARIANTS.items())
                for i in range(calls):
                    for label, overlay in order[i % 3:] + order[:i % 3]:  # rotating order
                        first, total, tool_call = await one_call(session, url, keys[overlay])
                        assert first is not None and tool_call, "no text or no tool call"
                        figures[label][0].append(first)
                        figures[label][1].append(total)
        finally:
            await runner.cleanup()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20, help="calls per variant")
    parser.add_argument("--chunk-delay-ms", type=float, default=2.0,
                        help="the engine's pause between stream events")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{tmp}/bench.db"
        upgrade(db)  # before the loop starts: migrations run their own
        figures = asyncio.run(run(args.calls, args.chunk_delay_ms / 1000, db, f"{tmp}/data"))
    base_first, base_total = (statistics.median(v) for v in figures["plain"])
    print(f"one streamed reply (text, then a tool call), {args.chunk_delay_ms:g} ms per "
          f"event, {args.calls} calls per variant, medians")
    print(f"{'variant':<30}{'first content ms':>18}{'whole reply ms':>16}"
          f"{'first / plain':>15}{'whole / plain':>15}")
    for label, (firsts, totals) in figures.items():
        first, total = statistics.median(firsts), statistics.median(totals)
        print(f"{label:<30}{first * 1000:>18.1f}{total * 1000:>16.1f}"
              f"{first / base_first:>15.2f}{total / base_total:>15.2f}")


if __name__ == "__main__":
    main()
