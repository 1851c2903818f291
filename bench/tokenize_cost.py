"""CPU of one tokenize question of the `openai`-flavour path, by context (no engine).

    python bench/tokenize_cost.py                 # contexts 500, 10k and 70k tokens, ~10 s
    python bench/tokenize_cost.py --contexts 70000
    python bench/tokenize_cost.py --flavor-compare  # whole proxies: bench/flavor_compare.py

An upstream that returns no token ids has them asked of its ``/tokenize`` by the writer
(proxy.tokens.resolve): for each call, the prompt (the whole conversation sent, every
prompt id read back) and the completion. This times the prompt's question as the proxy
asks it (``Vllm.chat_prompt`` through ``UpstreamClient.post_json``) against an in-process
``/tokenize`` that answers with a prepared body of as many ids: process CPU per question,
the answering side's read of the request included, the minimum over rounds.
"""

from __future__ import annotations

import argparse
import random
import socket
import sys
import time
from pathlib import Path

import msgspec
import uvloop
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tracetap.proxy.tokens.engine_tokenizer import Vllm
from tracetap.proxy.upstream.client import UpstreamClient


def conversation(tokens: int) -> dict:
    """A system prompt and 2,000-word tool results, one word a token."""
    def text(n: int) -> str:
        return " ".join(f"w{random.randrange(150_000)}" for _ in range(n))
    messages = [{"role": "system", "content": text(min(1000, tokens))}]
    left, turn = tokens - 1000, 0
    while left > 0:
        n = min(2000, left)
        messages.append({"role": "tool", "content": text(n), "tool_call_id": f"c{turn}"})
        left, turn = left - n, turn + 1
    return {"model": "m", "messages": messages, "max_tokens": 400, "logprobs": True}


async def measure(tokens: int, rounds: int, per_round: int) -> float:
    request = conversation(tokens)
    answer = msgspec.json.encode({"count": tokens, "max_model_len": 131_072,
                                  "tokens": [random.randrange(151_000) for _ in range(tokens)]})

    async def tokenize(req: web.Request) -> web.Response:
        await req.read()
        return web.Response(body=answer, content_type="application/json")

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/tokenize", tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    await web.TCPSite(runner, "127.0.0.1", port).start()
    client = UpstreamClient(timeout=30, connect_timeout=5, max_connections=4)
    await client.start()
    try:
        tokenizer = Vllm(client, f"http://127.0.0.1:{port}")
        best = float("inf")
        for _ in range(rounds):
            started = time.process_time()
            for _ in range(per_round):
                ids = await tokenizer.chat_prompt(request)
            best = min(best, (time.process_time() - started) / per_round)
            assert len(ids) == tokens
        return best
    finally:
        await client.close()
        await runner.cleanup()


def main() -> int:
    if "--flavor-compare" in sys.argv:  # the rest of the arguments are flavor_compare's
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from flavor_compare import main as compare
        return compare([a for a in sys.argv[1:] if a != "--flavor-compare"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[500, 10_000, 70_000])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=10)
    args = parser.parse_args()
    for tokens in args.contexts:
        cpu = uvloop.run(measure(tokens, args.rounds, args.per_round))
        print(f"context {tokens:>6} tokens: {cpu * 1000:.2f} ms of CPU per prompt question")
    return 0


if __name__ == "__main__":
    sys.exit(main())
