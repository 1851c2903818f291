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
import socket
import threading
import time

import openai
import pytest
from aiohttp import web
from helpers.hostile import MESSAGES, raw_request
from helpers.loop import free_port, wait_until
from helpers.servers import Proxy, ProxyProcess

from tracetap.demo.engine import EngineConfig, make_engine_app
from tracetap.proxy.overlays.examples import MAX_STEPS, Unchecked, schema_error
from tracetap.proxy.runtime.settings import Settings
from tracetap.storage.blocks import MAX_CUT_ELEMENTS, cut_text, join_text
from tracetap.storage.integrity import cause_of

# A stall this long is the attack working; a loaded machine adds well under it.
LATENCY_BOUND = 1.0
BIG = 1 << 20
CANNED = {"id": "chatcmpl-big", "object": "chat.completion", "created": 1, "model": "mock-model",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                       "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

# A small schema (14 KB) and small arguments that ask a naive validator for half a million
# checks: each of 700 items matches only the last of 700 alternatives (seconds of CPU).
BOMB_TOOL = {"type": "function", "function": {"name": "bomb", "parameters": {
    "type": "object", "properties": {"xs": {"type": "array", "items": {
        "anyOf": [{"type": "string"}] * 699 + [{"type": "integer"}]}}}}}}
BOMB_ARGS = json.dumps({"xs": [1] * 700})
BOMB_REPLY = {**CANNED, "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
    "role": "assistant", "content": None, "tool_calls": [{
        "id": "call-1", "type": "function",
        "function": {"name": "bomb", "arguments": BOMB_ARGS}}]}}]}


@pytest.fixture
def quick_upstream(serve_app) -> str:
    """The mock engine, except that a body over 1 MiB is answered at once without being
    parsed: the test measures the proxy's loop, not the engine's."""

    @web.middleware
    async def canned(request, handler):
        if request.content_length and request.content_length > BIG:
            await request.read()
            return web.json_response(CANNED)
        if b'"bomb"' in await request.read():  # the policy writes the arguments
            return web.json_response(BOMB_REPLY)
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

    def __enter__(self) -> Beside:
        return self

    def __exit__(self, *exc) -> None:
        self.client.close()

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
    """``work()`` in a thread; its result (or the exception it raised) in the list."""
    out: list = []

    def run() -> None:
        try:
            out.append(work())
        except Exception as exc:  # handed to the test to assert on
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
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
        with Beside(proxy.episode_url("beside")) as beside:
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


def test_a_body_is_cut_into_a_bounded_number_of_blocks():
    messages = [{"role": "user", "content": str(i)} for i in range(3 * MAX_CUT_ELEMENTS)]
    text = json.dumps({"model": "m", "messages": messages, "max_tokens": 2})
    pieces, prefix = cut_text(text, "messages")
    assert len(pieces) == MAX_CUT_ELEMENTS + 2  # before the list, each message, the rest
    assert join_text(data for _, data in pieces) == text
    # The next call of the conversation continues after the prefix, bounded again.
    longer = json.dumps({"model": "m", "messages": [*messages, *messages], "max_tokens": 2})
    again, _ = cut_text(longer, "messages", previous=prefix)
    assert len(pieces) - 1 < len(again) <= len(pieces) - 1 + MAX_CUT_ELEMENTS + 2
    assert join_text(data for _, data in again[len(pieces) - 1:]) == longer[prefix.length:]


# -- The shipped tool-arguments validator on the agent's schema ----------------------------

def test_the_validator_checks_ordinary_schemas_and_gives_up_on_costly_ones():
    schema = BOMB_TOOL["function"]["parameters"]
    assert schema_error({"xs": [1, 2]}, schema) is None
    assert schema_error({"xs": [1, 2.5]}, schema) == "arguments.xs[1] matches none of its " \
        "allowed shapes"
    started = time.process_time()
    with pytest.raises(Unchecked):  # 700 x 700 steps: past MAX_STEPS
        schema_error(json.loads(BOMB_ARGS), schema)
    with pytest.raises(Unchecked):  # an enum is counted by its entries
        schema_error("x", {"enum": ["y"] * (MAX_STEPS + 1)})
    deep, value = {"type": "integer"}, 1
    for _ in range(500):  # nested deeper than any tool's arguments: no RecursionError
        deep, value = {"type": "array", "items": deep}, [value]
    with pytest.raises(Unchecked):
        schema_error(value, deep)
    assert time.process_time() - started < 1.0

VALIDATOR = "validator=tracetap.proxy.overlays.examples:tool_args_validator"


def test_the_tool_args_validator_bounds_what_an_agents_schema_costs(
        quick_upstream, migrated_sqlite, tmp_path):
    proxy = _proxy(quick_upstream, migrated_sqlite(tmp_path / "v.db"), tmp_path,
                   "--overlay", VALIDATOR)
    try:
        assert proxy.admin("POST", "/tracetap/episodes",
                           {"id": "bomb", "overlay": "validator"})[0] == 201
        agent = openai.OpenAI(base_url=proxy.episode_url("bomb"), api_key="x", max_retries=0,
                              timeout=120)
        with agent, Beside(proxy.episode_url("beside")) as beside:
            beside.call()
            beside.latencies.clear()
            sent, replies = _in_thread(lambda: agent.chat.completions.create(
                model="mock-model", messages=MESSAGES, tools=[BOMB_TOOL], max_tokens=8))
            worst = beside.until(lambda: not sent.is_alive())
        assert not isinstance(replies[0], Exception), replies
        (call,) = replies[0].choices[0].message.tool_calls  # left unchecked, as it came
        assert call.function.arguments == BOMB_ARGS
        assert worst < LATENCY_BOUND, sorted(beside.latencies)[-5:]
    finally:
        proxy.stop()


# -- A stream that is never read, under a pause in abort mode ------------------------------

DEADLINE = 6.0
DUMMY_TOOL = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}


def test_a_stream_never_read_is_ended_at_the_call_deadline_and_frees_the_pause(
        loop_thread, quick_upstream, migrated_sqlite, tmp_path):
    settings = Settings(upstream=quick_upstream, db=migrated_sqlite(tmp_path / "d.db"),
                        data_dir=str(tmp_path / "data"), port=free_port(),
                        upstream_flavor="vllm", call_deadline=DEADLINE)
    proxy = Proxy(loop_thread, settings).start()
    # A long stream the pause cannot cut (a tool is declared: it could not be continued
    # exactly), to a client that reads nothing (a tiny receive window, never read).
    body = json.dumps({"model": "mock-model", "messages": MESSAGES, "stream": True,
                       "tools": [DUMMY_TOOL], "tool_choice": "none",
                       "max_tokens": 30_000, "mock_completion_tokens": 30_000}).encode()
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        stuck.connect(("127.0.0.1", settings.port))
        stuck.sendall(b"POST /episodes/stuck/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        started = time.monotonic()
        wait_until(lambda: proxy.state.gate.inflight == 1, "the stream in flight")
        status, paused = proxy.admin("POST", "/tracetap/pause",
                                     {"mode": "abort", "timeout": 3 * DEADLINE})
        waited = time.monotonic() - started
        assert status == 200 and paused["drained"] is True, paused
        assert waited < 2 * DEADLINE, waited
        assert proxy.admin("POST", "/tracetap/resume", {})[0] == 200
        with Beside(proxy.episode_url("beside")) as beside:
            beside.call()  # the proxy serves on
        (call,) = wait_until(lambda: proxy.calls("stuck"), "the stuck call stored")
        assert call["status"] == "client_stalled", call["status"]
        assert "--call-deadline 6 s" in call["error"] and "not read" in call["error"]
        assert cause_of(call["status"], call["http_status"]) == "agent_stalled"  # not infra
        stuck.settimeout(30)
        received = b""
        while chunk := stuck.recv(1 << 20):  # closed by the proxy: the stream was cut
            received += chunk
        assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received
    finally:
        stuck.close()
        proxy.stop()


def test_a_reply_not_begun_by_the_deadline_is_a_504_in_the_clients_shape(
        loop_thread, quick_upstream, migrated_sqlite, tmp_path):
    settings = Settings(upstream=quick_upstream, db=migrated_sqlite(tmp_path / "d.db"),
                        data_dir=str(tmp_path / "data"), port=free_port(),
                        upstream_flavor="vllm", call_deadline=1.0)
    proxy = Proxy(loop_thread, settings).start()
    try:
        client = openai.OpenAI(base_url=proxy.episode_url("slow"), api_key="x", max_retries=0)
        with client, pytest.raises(openai.APIStatusError) as raised:
            client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                           max_tokens=2, extra_body={"mock_delay_s": 5})
        assert raised.value.status_code == 504
        assert raised.value.body["code"] == "deadline_exceeded"
        (call,) = proxy.calls("slow")
        assert call["status"] == "deadline_exceeded"
        assert cause_of(call["status"], call["http_status"]) == "deadline_exceeded"
    finally:
        proxy.stop()
