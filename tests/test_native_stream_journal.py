"""A native Messages or Responses stream is journaled before the client sees its end.

Neither API ends its stream with ``data: [DONE]``: the end is an event that carries data
(Messages' ``message_stop``, Responses' ``response.completed``), which only capture
recognises (``ended``). The upstreams here keep their connection open after that event,
as a slow engine or a proxy in front of it may: the call must be in the database by the
time the client has read the end, not when the upstream lets go (test_relay.py says the
same of chat's [DONE]).
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
import pytest
from aiohttp import web
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.proxy.runtime.settings import Settings


def _sse(kind: str, data: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + json.dumps(data).encode() + b"\n\n"


MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
           "model": "m", "stop_reason": None, "stop_sequence": None,
           "usage": {"input_tokens": 3, "output_tokens": 0}}
MESSAGES_STREAM = [
    _sse("message_start", {"type": "message_start", "message": MESSAGE}),
    _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
    _sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "hi there"}}),
    _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
    _sse("message_delta", {"type": "message_delta", "usage": {"output_tokens": 2},
                           "delta": {"stop_reason": "end_turn", "stop_sequence": None}}),
    _sse("message_stop", {"type": "message_stop"}),
]
RESPONSE = {"id": "resp_1", "object": "response", "created_at": 1700000000, "model": "m",
            "status": "completed", "output": [
                {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                 "content": [{"type": "output_text", "text": "hi there", "annotations": []}]}],
            "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}}
RESPONSES_STREAM = [
    _sse("response.created", {"type": "response.created", "sequence_number": 0,
                              "response": {**RESPONSE, "status": "in_progress", "output": []}}),
    _sse("response.output_text.delta", {
        "type": "response.output_text.delta", "sequence_number": 1, "item_id": "msg_1",
        "output_index": 0, "content_index": 0, "delta": "hi there"}),
    _sse("response.completed", {"type": "response.completed", "sequence_number": 2,
                                "response": RESPONSE}),
]


class HeldUpstream:
    """Writes its stream event by event, then keeps the connection open until released."""

    def __init__(self, loop_thread, path: str, events: list[bytes]):
        self.loop_thread = loop_thread
        self.path, self.events = path, events
        self.released = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post(self.path, self.respond)
        return app

    async def respond(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        for event in self.events:
            await reply.write(event)
            await asyncio.sleep(0)  # each event its own read at the proxy
        await self.released.wait()
        await reply.write_eof()
        return reply

    def release(self) -> None:
        self.loop_thread.loop.call_soon_threadsafe(self.released.set)


@pytest.fixture
def native(loop_thread, serve_app, migrated_sqlite, tmp_path):
    """(upstream, proxy) for one API, the proxy sending it on natively (no translation)."""
    started = []

    def start(path: str, events: list[bytes]) -> tuple[HeldUpstream, Proxy]:
        upstream = HeldUpstream(loop_thread, path, events)
        settings = Settings(upstream=serve_app(upstream.app()) + "/v1",
                            db=migrated_sqlite(tmp_path / "tracetap.db"),
                            data_dir=str(tmp_path / "d"), port=free_port(),
                            translate="none", upstream_flavor="vllm")
        proxy = Proxy(loop_thread, settings).start()
        started.append((upstream, proxy))
        return upstream, proxy

    yield start
    for upstream, proxy in started:
        upstream.release()  # a failed test must not leave the proxy waiting on it
        proxy.stop()


def _stored_as_the_end_is_read(stream, end: str, upstream: HeldUpstream, proxy: Proxy,
                                episode: str) -> list[dict]:
    """Read the SDK's ``stream`` up to its ``end`` event, then the calls stored by then,
    while the upstream still holds its connection open."""
    kinds = []
    for event in stream:
        kinds.append(event.type)
        if event.type == end:
            break
    assert kinds[-1] == end
    calls = proxy.calls(episode)
    upstream.release()
    stream.close()
    return calls


def test_a_native_messages_stream_is_journaled_before_the_client_sees_message_stop(native):
    upstream, proxy = native("/v1/messages", MESSAGES_STREAM)
    agent = anthropic.Anthropic(base_url=proxy.url + "/episodes/ms", api_key="x",
                                max_retries=0)
    with agent:
        calls = _stored_as_the_end_is_read(agent.messages.create(
            model="m", max_tokens=8, stream=True, messages=[{"role": "user", "content": "hi"}]),
            "message_stop", upstream, proxy, "ms")
    [call] = calls
    assert call["endpoint"] == "messages" and call["status"] == "ok"
    assert call["choices"][0]["text"] == "hi there"
    assert call["choices"][0]["finish_reason"] == "stop"
    assert proxy.calls("ms") == calls  # and never a second time


def test_a_native_responses_stream_is_journaled_before_the_client_sees_it_completed(native):
    upstream, proxy = native("/v1/responses", RESPONSES_STREAM)
    agent = openai.OpenAI(base_url=proxy.episode_url("rs"), api_key="x", max_retries=0)
    with agent:
        calls = _stored_as_the_end_is_read(
            agent.responses.create(model="m", input="hi", stream=True),
            "response.completed", upstream, proxy, "rs")
    [call] = calls
    assert call["endpoint"] == "responses" and call["status"] == "ok"
    assert call["choices"][0]["text"] == "hi there"
    assert proxy.calls("rs") == calls
