"""CPU of one tokenize question of the `openai`-flavour path, by context (no engine).

    python bench/tokenize_cost.py                 # contexts 500, 10k and 70k tokens, ~10 s
    python bench/tokenize_cost.py --contexts 70000
    python bench/tokenize_cost.py --flavor-compare  # whole proxies: bench/flavor_compare.py

An upstream that returns no token ids has them asked of its ``/tokenize`` by the writer
(proxy.tokens.resolve): for each call, the prompt (the whole conversation sent, every
prompt id read back) and the completion. This times the prompt's question as the proxy
asks it (``Vllm.chat_prompt_array`` through ``UpstreamClient.post_raw``, the answer's ids
read by ``PromptPrefixes``) against an in-process ``/tokenize`` that answers with a
prepared body of as many ids: process CPU per question, the answering side's read of the
request included, the minimum over rounds. Two rows a context: the episode's first
question (every id decoded) and an agent's next one (its answer extends the last by 300
ids: only those are decoded).
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
from tracetap.proxy.tokens.prompt_prefix import PromptPrefixes
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


async def measure(tokens: int, rounds: int, per_round: int) -> tuple[float, float]:
    request = msgspec.json.encode(conversation(tokens)).decode()
    last = [random.randrange(151_000) for _ in range(tokens)]
    ids = last + [random.randrange(151_000) for _ in range(300)]
    answers = {n: msgspec.json.encode({"count": n, "max_model_len": 131_072,
                                       "tokens": ids[:n]}) for n in (tokens, tokens + 300)}
    answer = [answers[tokens]]

    async def tokenize(req: web.Request) -> web.Response:
        await req.read()
        return web.Response(body=answer[0], content_type="application/json")

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
        whole = await _best(tokenizer, request, rounds, per_round, None, tokens)
        answer[0] = answers[tokens + 300]
        nxt = await _best(tokenizer, request, rounds, per_round, answers[tokens], tokens + 300)
        return whole, nxt
    finally:
        await client.close()
        await runner.cleanup()


async def _best(tokenizer: Vllm, request: str, rounds: int, per_round: int,
                last: bytes | None, expect: int) -> float:
    """CPU a question; ``last``: each episode's previous answer, held before it is asked."""
    best = float("inf")
    for _ in range(rounds):
        prefixes = PromptPrefixes()
        episodes = [f"e{i}" if last else None for i in range(per_round)]
        for episode in episodes:
            if episode is not None:
                prefixes.decode_packed(episode, _tokens(last))
        started = time.process_time()
        for episode in episodes:
            _ids, packed = prefixes.decode_packed(episode,
                                                  await tokenizer.chat_prompt_array(request))
        best = min(best, (time.process_time() - started) / per_round)
        assert len(packed) == 4 * expect and prefixes.extended == (per_round if last else 0)
    return best


def _tokens(answer: bytes) -> bytes:
    return bytes(msgspec.json.decode(answer, type=dict[str, msgspec.Raw])["tokens"])


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
        whole, nxt = uvloop.run(measure(tokens, args.rounds, args.per_round))
        print(f"context {tokens:>6} tokens: {whole * 1000:.2f} ms of CPU per prompt question "
              f"(an episode's first), {nxt * 1000:.2f} ms (an agent's next: 300 new ids)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
