"""The agentic replay's engine: vLLM-shaped chat streams whose own cost is flat in context.

It answers ``/v1/chat/completions`` for the sessions of ``bench/agentic_shape.py``: the
turn is read from the marker that starts the last tool result (no decoding of the
messages), each event of every turn is encoded once at start-up, and the first chunk's
``prompt_token_ids`` (asked for with ``return_token_ids``, as vLLM does) is one slice of
the session's precomputed ids. Logprobs, token ids and the usage chunk come only when
asked for, so a client talking to it directly gets exactly what it asked for.

    python bench/agentic_engine.py --port 8000 --sessions 10 --turns 30 --tool 2000 --out 400
"""

from __future__ import annotations

import argparse
import asyncio
import re

import msgspec
from agentic_shape import CREATED, MODEL, Session, Sizes, encode
from aiohttp import web
from upstream import ChatRequest, models, version

_MARKER = re.compile(rb"\[agentic s=(\d+) t=(\d+)\]")
_SSE = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


_decode = msgspec.json.Decoder(ChatRequest).decode  # msgspec skips the messages in C


class Engine:
    def __init__(self, sizes: Sizes, sessions: int):
        self.sizes = sizes
        self.sessions = [Session(sizes, n) for n in range(sessions)]
        self._events: dict[tuple[int, int, bool, bool], list[bytes]] = {}

    def events(self, session: int, turn: int, logprobs: bool, token_ids: bool) -> list[bytes]:
        """The turn's token events, the first without its closing brace (the prompt ids
        may still go in)."""
        key = (session, turn, logprobs, token_ids)
        cached = self._events.get(key)
        if cached is not None:
            return cached
        s = self.sessions[session]
        texts, ids, values = s.completion_text(turn), s.outs[turn], s.logprobs(turn)
        head = {"id": f"chatcmpl-{session}-{turn}", "object": "chat.completion.chunk",
                "created": CREATED, "model": MODEL}
        out = []
        last = len(texts) - 1
        for i, text in enumerate(texts):
            delta = {"role": "assistant", "content": text} if i == 0 else {"content": text}
            choice: dict = {"index": 0, "delta": delta, "logprobs": None}
            if logprobs:
                choice["logprobs"] = {"content": [{"token": text, "logprob": values[i],
                                                   "bytes": list(text.encode()),
                                                   "top_logprobs": []}]}
            choice["finish_reason"] = "length" if i == last else None
            if token_ids:
                choice["token_ids"] = [ids[i]]
            data = encode({**head, "choices": [choice]})
            out.append(data[:-1] if i == 0 else b"data: " + data + b"\n\n")
        self._events[key] = out
        return out

    def first_event(self, session: int, turn: int, head: bytes, token_ids: bool) -> bytes:
        if not token_ids:
            return b"data: " + head + b"}\n\n"
        blob, ends = self.sessions[session].ids_json
        return b"".join((b"data: ", head, b',"prompt_token_ids":[', blob[:ends[turn]],
                         b"]}\n\n"))

    def usage_event(self, session: int, turn: int) -> bytes:
        prompt = self.sizes.context(turn)
        return b"data: " + encode({
            "id": f"chatcmpl-{session}-{turn}", "object": "chat.completion.chunk",
            "created": CREATED, "model": MODEL, "choices": [],
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt + self.sizes.out,
                      "completion_tokens": self.sizes.out}}) + b"\n\n"


ENGINE = web.AppKey("engine", Engine)
TOKEN_DELAY = web.AppKey("token_delay", float)


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    found = None
    at = body.rfind(b"[agentic s=")
    if at >= 0:
        found = _MARKER.match(body, at)
    if found is None:
        return web.json_response({"error": {"message": "not an agentic turn"}}, status=400)
    engine: Engine = request.app[ENGINE]
    session, turn = int(found[1]), int(found[2])
    req = _decode(body)
    del body
    if not req.stream:
        return web.json_response({"error": {"message": "the replay streams"}}, status=400)
    logprobs, token_ids = bool(req.logprobs), bool(req.return_token_ids)
    usage = bool(req.stream_options and req.stream_options.include_usage)
    events = engine.events(session, turn, logprobs, token_ids)
    response = web.StreamResponse(headers=_SSE)
    await response.prepare(request)
    await response.write(engine.first_event(session, turn, events[0], token_ids))
    delay = request.app[TOKEN_DELAY]
    for event in events[1:]:
        if delay:
            await asyncio.sleep(delay)
        await response.write(event)
    if usage:
        await response.write(engine.usage_event(session, turn))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def make_app(sizes: Sizes, sessions: int, warm: bool = True,
             token_delay: float = 0.0) -> web.Application:
    engine = Engine(sizes, sessions)
    if warm:  # encode every event now, so no arm pays for it
        for n in range(sessions):
            _ = engine.sessions[n].ids_json
            for t in range(sizes.turns):
                engine.events(n, t, False, False)
                engine.events(n, t, True, True)
    app = web.Application(client_max_size=256 << 20)
    app[ENGINE] = engine
    app[TOKEN_DELAY] = token_delay
    app.router.add_post("/v1/chat/completions", chat)
    for path, handler in (("/v1/models", models), ("/version", version), ("/health", version)):
        app.router.add_get(path, handler)  # bench/upstream.py's: a vLLM that owns its model
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--sessions", type=int, default=10, help="sessions it can answer")
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--tool", type=int, default=2000)
    parser.add_argument("--out", type=int, default=400)
    parser.add_argument("--system", type=int, default=1000)
    parser.add_argument("--token-delay", type=float, default=0.0,
                        help="seconds between a stream's events (0: as fast as it can)")
    args = parser.parse_args()
    import uvloop

    sizes = Sizes(args.sessions, args.turns, args.tool, args.out, args.system)
    web.run_app(make_app(sizes, args.sessions, token_delay=args.token_delay), host=args.host,
                port=args.port, print=None, access_log=None, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
