"""The untrusted agent against everyone else's latency: one request must not stall the
proxy for the other clients.

- Storing a 5 MiB request of tiny messages (cut into blocks, hashed, packed, indexed for
  search) happens off the event loop and makes a bounded number of blocks.
- The shipped tool-arguments validator bounds the work an agent's schema can ask for.
- A per-call deadline ends a call whose stream is never read, freeing a weight-sync pause.
- Idle connections of one peer cannot lock another client out.

Each runs a second client (the real openai SDK) beside the attack and asserts what it
sees. The bounds on its latency are generous (the suite shares a loaded 2-core machine)
but far below the seconds the attacks held the loop for before.
"""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest
from aiohttp import web
from helpers.hostile import MESSAGES, raw_request
from helpers.servers import ProxyProcess

from tracetap.demo.engine import EngineConfig, make_engine_app

# A stall this long is the attack working; a loaded machine adds well under it.
LATENCY_BOUND = 1.0
BIG = 1 << 20
CANNED = {"id": "chatcmpl-big", "object": "chat.completion", "created": 1, "model": "mock-model",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                       "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


@pytest.fixture
def quick_upstream(serve_app) -> str:
    """The mock engine, except that a body over 1 MiB is answered at once without being
    parsed: the test measures the proxy's loop, not the engine's."""

    @web.middleware
    async def canned(request, handler):
        if request.content_length and request.content_length > BIG:
            await request.read()
            return web.json_response(CANNED)
        return await handler(request)

    app = make_engine_app(EngineConfig(flavor="vllm"))
    app.middlewares.append(canned)
    return serve_app(app) + "/v1"


def _proxy(upstream: str, db: str, tmp_path, *extra: str) -> ProxyProcess:
    return ProxyProcess(upstream=upstream, db=db, data_dir=tmp_path / "d",
                        log=tmp_path / "proxy.log",
                        extra=("--upstream-flavor", "vllm", *extra)).start()


class Beside:
    """A normal client calling in a loop beside an attack; the slowest call it saw."""

    def __init__(self, base_url: str):
        self.client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0,
                                    timeout=60)
        self.latencies: list[float] = []

    def call(self) -> None:
        start = time.monotonic()
        reply = self.client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                                    max_tokens=2)
        self.latencies.append(time.monotonic() - start)
        assert reply.choices[0].message.content

    def until(self, done, timeout: float = 120.0) -> float:
        """Call until ``done()``; the slowest call's seconds."""
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "the attack did not end"
            self.call()
        self.call()
        return max(self.latencies)


def _in_thread(work) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(work()), daemon=True)
    thread.start()
    return thread, out


# -- Storing a big request of tiny items ---------------------------------------------------

def test_storing_5_mib_of_tiny_messages_does_not_stall_other_calls(
        quick_upstream, migrated_postgres, tmp_path):
    proxy = _proxy(quick_upstream, migrated_postgres, tmp_path)
    try:
        messages = [{"role": "user", "content": str(i)} for i in range(150_000)]
        body = json.dumps({"model": "mock-model", "messages": messages,
                           "max_tokens": 2}).encode()
        assert len(body) > 5 << 20
        beside = Beside(proxy.episode_url("beside"))
        beside.call()  # connections and the first call's work out of the way
        beside.latencies.clear()
        sent, replies = _in_thread(lambda: raw_request(
            proxy, "POST", "/episodes/big/v1/chat/completions",
            {"Content-Type": "application/json"}, body))

        def stored() -> bool:
            if sent.is_alive():
                return False
            status, episode = proxy.admin("GET", "/tracetap/episodes/big")
            return status == 200 and len(episode["calls"]) == 1

        worst = beside.until(stored)
        assert replies[0][0] == 200, replies
        assert worst < LATENCY_BOUND, sorted(beside.latencies)[-5:]
    finally:
        proxy.stop()
