"""Faults on either side: client gone, upstream dies, slow client, garbage from upstream."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import time

import openai
import pytest
from aiohttp import web
from helpers.http import metrics_text
from helpers.loop import free_port
from helpers.servers import Proxy, stored_calls

from tracetap.migrations import upgrade
from tracetap.proxy.runtime.settings import Settings


def _stream_request(port: int, path: str, body: dict) -> socket.socket:
    """Send a streaming request by hand and return the socket, unread."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def _poll_calls(proxy: Proxy, episode: str, timeout: float = 20.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        calls = proxy.calls(episode)
        if calls:
            return calls
        time.sleep(0.05)  # the handler finishes when it notices the client is gone
    raise AssertionError(f"no call stored for {episode}")


class Trickle:
    """An upstream that streams one token every 10 ms for a minute, unless cut off."""

    def __init__(self):
        self.sent = 0
        self.outcome: str | None = None  # "cut" or "finished"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i in range(6000):
                chunk = {"id": "t", "model": "trickle", "choices": [{
                    "index": 0, "delta": {"content": "x"}, "token_ids": [i],
                    "logprobs": {"content": [{"token": "x", "logprob": -0.5}]},
                    "finish_reason": None}]}
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.sent += 1
                await asyncio.sleep(0.01)
            self.outcome = "finished"
        except (ConnectionResetError, asyncio.CancelledError):
            self.outcome = "cut"  # the proxy dropped our connection: generation stops
            raise
        return response


def _requests_by_code(proxy) -> dict[str, float]:
    metrics = metrics_text(proxy.url)
    found = {}
    for labels, value in re.findall(r"^tracetap_requests_total\{(.*)\} (\S+)$", metrics,
                                    re.MULTILINE):
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if pairs["route"] == "chat_completions":
            found[pairs["code"]] = float(value)
    return found


def test_client_disconnect_mid_stream_cancels_upstream_stores_the_call_and_counts_499(
        loop_thread, serve_app, db_url, tmp_path):
    trickle = Trickle()
    upstream = serve_app(trickle.app())
    settings = Settings(upstream=upstream + "/v1", db=db_url, data_dir=str(tmp_path / "d"),
                        port=free_port(), upstream_flavor="vllm")
    proxy = Proxy(loop_thread, settings).start()
    try:
        sock = _stream_request(settings.port, "/episodes/gone/v1/chat/completions", {
            "model": "trickle", "stream": True, "messages": [{"role": "user", "content": "x"}]})
        received = b""
        while received.count(b"data: ") < 5:
            received += sock.recv(65536)
        sock.close()
        deadline = time.monotonic() + 30
        while trickle.outcome is None:
            assert time.monotonic() < deadline, "the upstream request was never cancelled"
            time.sleep(0.05)  # polling: the proxy notices at its next write to the client
        assert trickle.outcome == "cut" and trickle.sent < 6000
        [call] = _poll_calls(proxy, "gone")
        assert (call["status"], call["error"]) == ("client_disconnected",
                                                   "client went away mid-stream")
        ids = call["choices"][0]["completion_ids"]
        assert ids == list(range(len(ids))) and 5 <= len(ids) <= trickle.sent
        assert len(call["choices"][0]["completion_logprobs"]) == len(ids)
        assert _requests_by_code(proxy) == {"499": 1.0}
    finally:
        proxy.stop()


def test_upstream_failing_mid_stream_ends_the_client_stream_and_is_recorded(proxy):
    client = openai.OpenAI(base_url=proxy.episode_url("upfail"), api_key="x", max_retries=0)
    chunks = []
    with client, pytest.raises(openai.APIError):
        for chunk in client.chat.completions.create(
                model="mock-model", messages=[{"role": "user", "content": "x"}], stream=True,
                extra_body={"mock_fail_after_chunks": 6, "mock_completion_tokens": 50}):
            chunks.append(chunk)
    assert 0 < len(chunks) <= 6
    [call] = proxy.calls("upfail")
    # The record says how the upstream broke (aiohttp's error, as described).
    assert call["status"] == "upstream_error"
    assert call["error"].startswith("ClientPayloadError: Response payload is not completed")
    relayed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert call["choices"][0]["text"] == relayed


def test_garbage_in_the_upstream_stream_is_relayed_and_recorded(proxy):
    port = int(proxy.url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", "/episodes/garbage/v1/chat/completions", body=json.dumps({
        "model": "mock-model", "stream": True, "max_tokens": 8, "mock_garbage": True,
        "messages": [{"role": "user", "content": "x"}]}),
        headers={"Content-Type": "application/json"})
    body = conn.getresponse().read()
    conn.close()
    assert b"data: {this is not json" in body and body.rstrip().endswith(b"data: [DONE]")
    [call] = proxy.calls("garbage")
    assert call["status"] == "ok" and "unparseable" in call["error"]
    assert len(call["choices"][0]["completion_ids"]) == 8


def test_truncated_non_stream_reply_is_a_clear_error(proxy):
    client = openai.OpenAI(base_url=proxy.episode_url("trunc"), api_key="x", max_retries=0)
    with client, pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="mock-model", messages=[
            {"role": "user", "content": "x"}], extra_body={"mock_fail_after_chunks": 1})
    assert info.value.status_code == 502
    [call] = proxy.calls("trunc")
    assert call["status"] == "upstream_error"


def _text_only_upstream() -> web.Application:
    async def chat(request: web.Request) -> web.Response:
        return web.json_response({"id": "x", "object": "chat.completion", "model": "plain",
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant",
                                                           "content": "hi"}}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 1}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


def test_missing_logprobs_are_counted(loop_thread, serve_app, db_url, tmp_path):
    upstream = serve_app(_text_only_upstream())
    settings = Settings(upstream=upstream + "/v1", db=db_url,
                        data_dir=str(tmp_path / "d"), port=free_port(), upstream_flavor="openai")
    proxy = Proxy(loop_thread, settings).start()
    try:
        client = openai.OpenAI(base_url=proxy.episode_url("plain"), api_key="x")
        with client:
            reply = client.chat.completions.create(model="plain", messages=[
                {"role": "user", "content": "x"}])
        assert reply.choices[0].message.content == "hi"
        [call] = proxy.calls("plain")
        choice = call["choices"][0]
        assert choice["token_source"] == "none" and choice["completion_logprobs"] is None
        assert "tracetap_logprobs_missing_total 1.0" in metrics_text(proxy.url)
    finally:
        proxy.stop()


class Firehose:
    """An upstream that streams large events as fast as it is allowed to, and says whether
    it is blocked inside a write (pushed back) or between writes (merely slow)."""

    def __init__(self, total_events: int, event_bytes: int):
        self.total_events = total_events
        self.sent = 0
        self.writing = False
        self.event = ("data: " + json.dumps({"id": "f", "model": "f", "choices": [
            {"index": 0, "delta": {"content": "x" * event_bytes}, "finish_reason": None}]})
            + "\n\n").encode()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def chat(self, request: web.Request) -> web.StreamResponse:
        warm_up = (await request.json()).get("max_tokens") == 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(1 if warm_up else self.total_events):
            self.writing = True
            await response.write(self.event)
            self.writing = False
            if not warm_up:
                self.sent += len(self.event)
        await response.write(b"data: [DONE]\n\n")
        return response

    def stalled(self, quiet: float = 1.0, timeout: float = 60.0) -> None:
        """Return once the upstream has sat inside one write for ``quiet`` seconds."""
        deadline = time.monotonic() + timeout
        last, since = -1, time.monotonic()
        while not (self.writing and self.sent == last and time.monotonic() - since >= quiet):
            assert time.monotonic() < deadline, "the upstream was never pushed back"
            if self.sent != last or not self.writing:
                last, since = self.sent, time.monotonic()
            time.sleep(0.05)  # polling a condition; the assertions are on bytes and RSS


def test_slow_client_applies_backpressure_with_bounded_memory(
        serve_app, fresh_postgres, run_proxy):
    upgrade(fresh_postgres)
    # ~63 MiB if nothing pushed back. Loopback's socket buffers grow to hold ~20 MB between
    # the upstream and the client (seen under load), so half the total must be well above.
    total_events, event_bytes = 1000, 64 * 1024
    firehose = Firehose(total_events, event_bytes)
    upstream = serve_app(firehose.app())
    proxy = run_proxy(upstream + "/v1", fresh_postgres, "--upstream-flavor", "openai")
    with openai.OpenAI(base_url=proxy.episode_url("warm"), api_key="x") as client:
        list(client.chat.completions.create(model="f", messages=[{"role": "user",
                                            "content": "x"}], max_tokens=1, stream=True))
    baseline = proxy.rss_bytes()  # after one stream: what a first request loads is not growth
    sock = _stream_request(proxy.port, "/episodes/slow/v1/chat/completions", {
        "model": "f", "stream": True, "messages": [{"role": "user", "content": "x"}]})
    firehose.stalled()
    stalled_rss = proxy.rss_bytes()
    assert firehose.sent < total_events * (event_bytes + 100) / 2, "no backpressure upstream"
    assert stalled_rss - baseline < 16 * 1024 * 1024

    received = 0
    sock.settimeout(30)
    tail = b""
    while not tail.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
        data = sock.recv(1 << 20)
        if not data:
            break
        received += len(data)
        tail = (tail + data)[-64:]
    sock.close()
    assert received > total_events * event_bytes
    deadline = time.monotonic() + 20
    while not (calls := stored_calls(fresh_postgres, "slow")):
        assert time.monotonic() < deadline, "the slow call was never stored"
        time.sleep(0.1)  # the subprocess's writer commits within its flush interval
    assert calls[0]["status"] == "ok"
    assert len(calls[0]["choices"][0]["text"]) == total_events * event_bytes
