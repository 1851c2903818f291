"""Chat-completions upstreams with a script, the replies and stream chunks they send, and
a minimal translating server around one ``proxy.apis.*.translate`` module."""

from __future__ import annotations

import aiohttp
import msgspec
from aiohttp import web

from tracetap.proxy.http.sse import SSEParser


def translating_app(api, upstream: str, *, model_map=None, sent: list | None = None):
    """A minimal translating server around one ``proxy.apis.*.translate`` module: the
    client's API in, chat completions to ``upstream``, the client's API back (tests only;
    the proxy wires translation itself). Chat requests sent upstream go to ``sent``."""
    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        try:
            chat = api.to_chat(body, model_map=model_map)
        except api.Untranslatable as exc:
            return web.Response(status=400, body=api.ERRORS.body(api.untranslatable(exc)),
                                content_type="application/json")
        if sent is not None:
            sent.append(chat)
        async with aiohttp.ClientSession() as session, session.post(
                upstream + "/v1/chat/completions", json=chat) as up:
            if up.status != 200:
                return web.Response(status=up.status, content_type="application/json",
                                    body=api.error_from_chat(up.status, await up.read()))
            if not chat.get("stream"):
                return web.json_response(api.from_chat(await up.json(), body))
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            translator, parser, done = api.StreamTranslator(body), SSEParser(), False
            async for data in up.content.iter_any():
                for event in parser.feed(data):
                    if event.data == b"[DONE]":
                        events, done = translator.finish(), True
                    elif event.data is not None:
                        events = translator.feed(msgspec.json.decode(event.data))
                    else:
                        events = []
                    for encoded in events:
                        await out.write(encoded)
            if not done:
                await out.write(translator.error_event("upstream stream ended early"))
            await out.write_eof()
            return out

    app = web.Application()
    app.router.add_post("/v1/responses", handle)
    app.router.add_post("/v1/messages", handle)
    return app


def scripted_chat_app(reply) -> web.Application:
    """A chat-completions upstream that answers every request with ``reply``: a list of
    stream chunks (sent as SSE, then [DONE]), a whole body (dict), or (status, bytes)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        if isinstance(reply, tuple):
            return web.Response(status=reply[0], body=reply[1])
        if isinstance(reply, dict):
            return web.json_response(reply)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for chunk in reply:
            await out.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    return app


CHAT_USAGE = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18,
              "prompt_tokens_details": {"cached_tokens": 4},
              "completion_tokens_details": {"reasoning_tokens": 3}}


def chat_reply(text=None, reasoning=None, calls=(), finish="stop", usage=None, **choice):
    message = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            for cid, name, args in calls]
    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000,
            "model": "m", "choices": [{"index": 0, "message": message,
                                       "finish_reason": finish, **choice}]}
    if usage is not None:
        body["usage"] = usage
    return body


def stream_chunks(text=None, reasoning=None, calls=(), finish="stop", usage=None,
                  pieces=3) -> list[dict]:
    """The chunks a chat server streams for ``chat_reply(...)``, split into ``pieces``."""

    def split(s: str) -> list[str]:
        size = max(1, -(-len(s) // pieces))
        return [s[i:i + size] for i in range(0, len(s), size)] or [""]

    def chunk(delta=None, finish_reason=None, **extra):
        choice = {"index": 0, "delta": delta or {}, "finish_reason": finish_reason}
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000,
                "model": "m", "choices": [choice], **extra}

    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"reasoning_content": p}) for p in split(reasoning)] if reasoning else []
    out += [chunk({"content": p}) for p in split(text)] if text else []
    for index, (cid, name, args) in enumerate(calls):
        out.append(chunk({"tool_calls": [{"index": index, "id": cid, "type": "function",
                                          "function": {"name": name, "arguments": ""}}]}))
        out += [chunk({"tool_calls": [{"index": index, "function": {"arguments": p}}]})
                for p in split(args) if p]
    out.append(chunk(finish_reason=finish))
    if usage is not None:
        out.append({**chunk(), "choices": [], "usage": usage})
    return out
