"""A fast local OpenAI-compatible upstream: precomputed vLLM-shaped chat replies.

Every reply has 64 completion tokens. Logprobs, engine token ids and the stream's usage
chunk are included only when the request asks for them (as vLLM does), so a client
talking to it directly gets exactly what it asked for and the proxy's injections cost
what they would cost against a real engine. All bodies are built once at start-up;
a request costs one small msgspec decode and one or more socket writes.

Bodies are written by the standard library's ``json`` with non-ASCII text escaped
(``"w\u00e9..."``), not by the proxy's encoder: a proxy that decoded and re-encoded what
it relays would write ``é`` instead, and fail the benchmark's byte-identity check.

    python bench/upstream.py --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from itertools import product

import msgspec
from aiohttp import web

MODEL = "bench-model"
COMPLETION_TOKENS = 64
PROMPT_TOKENS = 48
CREATED = 1_700_000_000


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class ChatRequest(msgspec.Struct):
    """Only what decides which precomputed reply to send."""

    stream: bool | None = None
    logprobs: bool | None = None
    return_token_ids: bool | None = None
    stream_options: StreamOptions | None = None


_decode = msgspec.json.Decoder(ChatRequest).decode


def _encode(value) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True).encode()


def _tokens(seed: int = 7) -> tuple[list[str], list[int], list[float], list[int]]:
    rnd = random.Random(seed)
    words = [f" wé{rnd.randrange(10_000)}" for _ in range(COMPLETION_TOKENS)]
    ids = [rnd.randrange(151_000) for _ in range(COMPLETION_TOKENS)]
    logprobs = [-rnd.random() * 3 for _ in range(COMPLETION_TOKENS)]
    prompt_ids = [rnd.randrange(151_000) for _ in range(PROMPT_TOKENS)]
    return words, ids, logprobs, prompt_ids


WORDS, IDS, LOGPROBS, PROMPT_IDS = _tokens()
USAGE = {"prompt_tokens": PROMPT_TOKENS, "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS,
         "completion_tokens": COMPLETION_TOKENS}


def _entry(i: int) -> dict:
    word = WORDS[i]
    return {"token": word, "logprob": LOGPROBS[i], "bytes": list(word.encode()),
            "top_logprobs": []}


def whole_body(logprobs: bool, token_ids: bool) -> bytes:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "".join(WORDS), "tool_calls": []},
        "logprobs": {"content": [_entry(i) for i in range(COMPLETION_TOKENS)]}
        if logprobs else None,
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": IDS if token_ids else None,
    }
    return _encode({
        "id": "chatcmpl-bench", "object": "chat.completion", "created": CREATED, "model": MODEL,
        "choices": [choice], "usage": USAGE, "prompt_logprobs": None,
        "prompt_token_ids": PROMPT_IDS if token_ids else None,
    })


def stream_events(logprobs: bool, token_ids: bool, usage: bool) -> list[bytes]:
    """One SSE event per token (the first carries the role), then usage, then [DONE]."""
    events = []
    for i in range(COMPLETION_TOKENS):
        delta = {"role": "assistant", "content": WORDS[i]} if i == 0 else {"content": WORDS[i]}
        # vLLM sets logprobs explicitly on every chunk: null when not asked for.
        choice: dict = {"index": 0, "delta": delta,
                        "logprobs": {"content": [_entry(i)]} if logprobs else None}
        choice["finish_reason"] = "length" if i == COMPLETION_TOKENS - 1 else None
        if token_ids:
            choice["token_ids"] = [IDS[i]]
        chunk: dict = {"id": "chatcmpl-bench", "object": "chat.completion.chunk",
                       "created": CREATED, "model": MODEL, "choices": [choice]}
        if token_ids and i == 0:
            chunk["prompt_token_ids"] = PROMPT_IDS
        events.append(b"data: " + _encode(chunk) + b"\n\n")
    if usage:
        chunk = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": CREATED,
                 "model": MODEL, "choices": [], "usage": USAGE}
        events.append(b"data: " + _encode(chunk) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


BODIES = {(lp, ti): whole_body(lp, ti) for lp, ti in product((False, True), repeat=2)}
STREAMS = {key: stream_events(*key) for key in product((False, True), repeat=3)}
_MODELS = _encode({"object": "list", "data": [
    {"id": MODEL, "object": "model", "created": CREATED, "owned_by": "vllm",
     "root": MODEL, "parent": None, "max_model_len": 32768}]})
_JSON = {"Content-Type": "application/json"}
_SSE = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
TOKEN_DELAY = web.AppKey("token_delay", float)


async def chat(request: web.Request) -> web.StreamResponse:
    req = _decode(await request.read())
    logprobs, token_ids = bool(req.logprobs), bool(req.return_token_ids)
    if not req.stream:
        return web.Response(body=BODIES[logprobs, token_ids], headers=_JSON)
    usage = bool(req.stream_options and req.stream_options.include_usage)
    delay = request.app[TOKEN_DELAY]
    response = web.StreamResponse(headers=_SSE)
    await response.prepare(request)
    for event in STREAMS[logprobs, token_ids, usage]:
        await response.write(event)
        if delay:
            await asyncio.sleep(delay)
    await response.write_eof()
    return response


async def models(request: web.Request) -> web.Response:
    return web.Response(body=_MODELS, headers=_JSON)


async def version(request: web.Request) -> web.Response:
    return web.Response(body=b'{"version":"0.11.0"}', headers=_JSON)


def make_app(token_delay: float = 0.0) -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    app[TOKEN_DELAY] = token_delay
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/version", version)
    app.router.add_get("/health", version)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--token-delay", type=float, default=0.0,
                        help="seconds between stream events (0: as fast as possible)")
    args = parser.parse_args()
    import uvloop

    web.run_app(make_app(args.token_delay), host=args.host, port=args.port, print=None,
                access_log=None, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
