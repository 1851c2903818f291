"""Sending the mock engine's answers, with the per-request faults a client can ask for:
a truncated body or stream (``mock_fail_after_chunks``), garbage (``mock_garbage``) and
a delay between chunks (``mock_chunk_delay_s``); and llama-cpp-python's early end of a
stream when another request arrives (``interrupted``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import msgspec
from aiohttp import web

from tracetap.demo.engine_common import ABORTS
from tracetap.demo.wire import EngineRequest


def _abort(request: web.Request) -> None:
    """Drop the connection mid-body: the client sees a truncated response."""
    if request.transport is not None:
        request.transport.close()


async def send_body(request: web.Request, req: EngineRequest, body: dict) -> web.StreamResponse:
    data = msgspec.json.encode(body)
    if req.mock_garbage:
        return web.Response(body=data[: len(data) // 2], content_type="application/json")
    if req.mock_fail_after_chunks is None:
        return web.Response(body=data, content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    resp.content_length = len(data)
    await resp.prepare(request)
    await resp.write(data[: len(data) // 2])
    _abort(request)
    return resp


async def send_stream(
    request: web.Request,
    req: EngineRequest,
    chunks: Iterator[dict],
    delay_s: float,
    named: bool = False,
    interrupted: Callable[[], bool] | None = None,
) -> web.StreamResponse:
    """OpenAI-style ``data:`` chunks ending in ``[DONE]``, or, ``named``, events whose
    ``event:`` line repeats their ``type`` (Responses and Messages streams) and no ``[DONE]``.
    ``delay_s`` between chunks unless the request sets ``mock_chunk_delay_s``. When
    ``interrupted()`` turns true after a chunk, ``[DONE]`` follows at once."""
    delay = delay_s if req.mock_chunk_delay_s is None else req.mock_chunk_delay_s
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    try:
        for count, chunk in enumerate(chunks):
            if count == req.mock_fail_after_chunks:
                _abort(request)
                return resp
            head = b"event: " + chunk["type"].encode() + b"\n" if named else b""
            if req.mock_garbage and count == 2:
                await resp.write(head + b"data: {this is not json\n\n")
            await resp.write(head + b"data: " + msgspec.json.encode(chunk) + b"\n\n")
            if delay > 0:
                await asyncio.sleep(delay)
            if interrupted is not None and interrupted():
                break
        if not named:
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:  # the client went away: the request is aborted
        request.app[ABORTS].count += 1
    return resp
