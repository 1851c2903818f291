"""What the agent may reach besides the model API (``proxy.call.handlers``): the base-URL probe,
answered by the proxy; the exposed paths that are not captured (the models list,
tokenize, ``--allow-path``), relayed untouched and recorded in their episode.

The upstreams here record every request they get (method, path and query, headers,
body) and sign their replies with a header of their own, so what was relayed, and to
which upstream, can be compared exactly.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time

import pytest
from aiohttp import web
from helpers.chat_upstreams import chat_reply
from helpers.http import fetch, metrics_text
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.proxy.runtime.settings import Settings

# An allowed path longer than the record's 32-character endpoint column.
LONG_PATH = "/v1/embeddings/of/a/path/longer/than/the/column"
RESPONSE = {"id": "resp_1", "object": "response", "created_at": 1700000000, "model": "m",
            "status": "completed", "output": [
                {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                 "content": [{"type": "output_text", "text": "hi", "annotations": []}]}],
            "usage": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}}


# Every request the tests send as the agent carries this header (relayed like any other).
AGENT = {"X-Sent-By": "agent"}


class RecordingEngine:
    """An upstream that records what it receives and names itself in each reply."""

    def __init__(self, name: str):
        self.name = name
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1/embeddings/broken", self.broken)
        app.router.add_post("/v1/embeddings/slow", self.slow)
        app.router.add_post(LONG_PATH, self.tokenize)
        return app

    def from_agent(self) -> list[tuple[str, str, dict[str, str], bytes]]:
        """What reached the engine on the agent's behalf. The proxy also asks the engine's
        /tokenize itself (its flavor probe; ids for replies that came without them:
        proxy.resolve), at times of its own."""
        return [seen for seen in self.seen if seen[2].get("X-Sent-By") == "agent"]

    async def _record(self, request: web.Request) -> None:
        self.seen.append((request.method, request.path_qs, dict(request.headers),
                          await request.read()))

    def _signed(self) -> dict[str, str]:
        return {"X-Engine": self.name}

    async def models(self, request):
        await self._record(request)
        return web.json_response({"object": "list", "data": [{"id": "m"}]},
                                 headers=self._signed())

    async def tokenize(self, request):
        await self._record(request)
        return web.json_response({"tokens": [1, 2, 3], "count": 3}, headers=self._signed())

    async def chat(self, request):
        await self._record(request)
        return web.json_response(chat_reply("hi"), headers=self._signed())

    async def responses(self, request):
        await self._record(request)
        return web.json_response(RESPONSE, headers=self._signed())

    async def broken(self, request):
        """Half a body, then the connection cut."""
        await self._record(request)
        reply = web.StreamResponse(headers={"Content-Type": "application/json"})
        reply.enable_chunked_encoding()
        await reply.prepare(request)
        await reply.write(b'{"data": [')
        await asyncio.sleep(0.05)
        request.transport.abort()
        return reply

    async def slow(self, request):
        """A body that takes its time: the client leaves before the end."""
        await self._record(request)
        reply = web.StreamResponse(headers={"Content-Type": "application/json"})
        await reply.prepare(request)
        for _ in range(100):
            await reply.write(b" " * 1024)
            await asyncio.sleep(0.05)
        await reply.write(b"{}")
        return reply


@pytest.fixture
def start(loop_thread, serve_app, migrated_sqlite, tmp_path):
    """start(n, **settings) -> (engines, proxy): n recording upstreams behind one proxy."""
    started = []

    def go(n: int = 1, **settings) -> tuple[list[RecordingEngine], Proxy]:
        engines = [RecordingEngine(f"e{i}") for i in range(n)]
        urls = [serve_app(engine.app()) + "/v1" for engine in engines]
        config = Settings(upstream=urls, db=migrated_sqlite(tmp_path / "t.db"),
                          data_dir=str(tmp_path / "d"), port=free_port(),
                          upstream_flavor=settings.pop("upstream_flavor", "vllm"),
                          allow_path=["POST /v1/embeddings/*"], **settings)
        proxy = Proxy(loop_thread, config).start()
        started.append(proxy)
        return engines, proxy

    yield go
    for proxy in started:
        proxy.stop()


def _request(proxy: Proxy, method: str, path: str, headers: dict | None = None,
             body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.settings.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={**AGENT, **(headers or {})})
        reply = conn.getresponse()
        return reply.status, dict(reply.headers), reply.read()
    finally:
        conn.close()


def _requests_total(proxy: Proxy, code: str) -> float:
    line = f'tracetap_requests_total{{code="{code}",route="passthrough"}}'
    for row in metrics_text(proxy.url).splitlines():
        if row.startswith(line):
            return float(row.split()[-1])
    return 0.0


@pytest.mark.parametrize("path", ["/episodes/probe", "/episodes/probe/v1", "/v1/", ""])
def test_the_base_url_probe_is_answered_by_the_proxy_itself(start, path):
    """Harnesses probe their base URL (Anthropic's CLI sends HEAD first): the proxy
    answers, and the episode id in the path never reaches the upstream."""
    [engine], proxy = start()
    status, body = fetch("GET", proxy.url + path)
    assert (status, body) == (200, b'{"status": "ok", "service": "tracetap"}')
    assert _request(proxy, "HEAD", path or "/")[0] == 200
    assert [p for _, p, _, _ in engine.seen if p in ("/", "/v1", "/v1/") or "probe" in p] == []


def test_a_passthrough_reaches_the_upstream_as_the_client_sent_it_and_back(start):
    [engine], proxy = start(forward_client_auth=True)
    status, headers, body = _request(proxy, "GET", "/episodes/pt/v1/models?page=2", {
        "Authorization": "Bearer client-own-key", "Accept-Encoding": "gzip, br",
        "X-Custom": "kept"})
    assert status == 200 and headers["X-Engine"] == "e0"  # the upstream's headers, relayed
    assert b'"data"' in body
    [(method, path_qs, sent, sent_body)] = [r for r in engine.seen if "page=2" in r[1]]
    assert (method, path_qs, sent_body) == ("GET", "/v1/models?page=2", b"")
    assert sent["Authorization"] == "Bearer client-own-key"  # --forward-client-auth
    assert sent["Accept-Encoding"] == "gzip, br"  # the client's choice, not the proxy's
    assert sent["X-Custom"] == "kept"
    assert "Content-Length" not in sent and "Transfer-Encoding" not in sent  # no body made up
    assert proxy.calls("pt") == []  # a GET is not recorded


def test_posted_passthroughs_are_recorded_in_their_episodes_order(start):
    """Each posted passthrough is a record of its episode: its place among the model
    calls, its status, the proxy instance, its time, its path (cut to the column)."""
    [engine], proxy = start()
    chat = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    json_type = {"Content-Type": "application/json"}
    tagged = {**json_type, "X-Tracetap-Episode": "mix"}  # /tokenize has no episode path
    for path in ("/v1/chat/completions", "/tokenize", "/v1/chat/completions", LONG_PATH):
        status, _, _ = _request(proxy, "POST", path, tagged,
                                chat if "chat" in path else b'{"prompt": "hi"}')
        assert status == 200, path
    assert [sent_body for _, p, _, sent_body in engine.from_agent() if p == "/tokenize"] == [
        b'{"prompt": "hi"}']
    calls = proxy.calls("mix")
    assert [(c["seq"], c["status"]) for c in calls] == [
        (0, "ok"), (1, "passthrough"), (2, "ok"), (3, "passthrough")]
    tokenize, long = calls[1], calls[3]
    assert tokenize["endpoint"] == "/tokenize" and tokenize["http_status"] == 200
    assert long["endpoint"] == LONG_PATH[:32] and len(long["endpoint"]) == 32
    for call in (tokenize, long):
        assert call["instance"] == proxy.state.instance
        assert call["t_start"] <= call["t_end"] <= time.time()
    assert _requests_total(proxy, "200") == 2


def _chats(engine: RecordingEngine) -> int:
    return sum(1 for _, path, _, _ in engine.seen if path == "/v1/chat/completions")


def test_a_passthrough_goes_to_the_upstream_its_episode_calls_go_to(start):
    """Two upstreams: an episode's tokenize reaches the engine its model calls reach
    (the one that has its prefix cache, and its model's tokenizer)."""
    engines, proxy = start(n=2)
    chat = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    json_type = {"Content-Type": "application/json"}
    placed = {}
    for episode in (f"ep{i}" for i in range(12)):
        tagged = {**json_type, "X-Tracetap-Episode": episode}
        before = [_chats(e) for e in engines]
        _request(proxy, "POST", "/v1/chat/completions", tagged, chat)
        [model] = [e.name for e, n in zip(engines, before, strict=True) if _chats(e) > n]
        _, headers, _ = _request(proxy, "POST", "/tokenize", tagged, b'{"prompt": "hi"}')
        placed[episode] = (model, headers["X-Engine"])
    assert all(model == tokenize for model, tokenize in placed.values()), placed
    assert {model for model, _ in placed.values()} == {"e0", "e1"}  # both are used


def test_a_relayed_path_is_open_without_an_episode_under_require_episode(start):
    """``--require-episode`` refuses untagged model calls, not the models list."""
    [engine], proxy = start(require_episode=True)
    assert _request(proxy, "GET", "/v1/models")[0] == 200
    status, _, _ = _request(proxy, "POST", "/v1/chat/completions",
                            {"Content-Type": "application/json"},
                            b'{"model": "m", "messages": []}')
    assert status == 400
    assert [p for _, p, _, _ in engine.from_agent()] == ["/v1/models"]


def test_an_upstream_cut_mid_body_is_a_cut_for_the_client_and_a_502_on_record(start):
    """The client must not take half a body for a whole one: its connection is cut too."""
    _, proxy = start()
    with pytest.raises((http.client.IncompleteRead, ConnectionError)):
        _request(proxy, "POST", "/episodes/cut/v1/embeddings/broken",
                 {"Content-Type": "application/json"}, b"{}")
    [call] = proxy.calls("cut")
    assert (call["status"], call["http_status"]) == ("passthrough", 502)
    assert _requests_total(proxy, "502") == 1


def test_a_client_gone_mid_passthrough_is_a_499_with_no_status_on_record(start):
    _, proxy = start()
    conn = http.client.HTTPConnection("127.0.0.1", proxy.settings.port, timeout=30)
    conn.request("POST", "/episodes/gone/v1/embeddings/slow", body=b"{}",
                 headers={"Content-Type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 200 and reply.read(1024)
    conn.sock.close()  # leave mid-body
    conn.close()
    deadline = time.monotonic() + 20
    while not (calls := proxy.calls("gone")):
        assert time.monotonic() < deadline, "the passthrough was never recorded"
        time.sleep(0.1)
    [call] = calls
    assert (call["status"], call["http_status"]) == ("passthrough", 0)
    assert _requests_total(proxy, "499") == 1


@pytest.mark.parametrize(("flavor", "upstream_path"), [
    ("vllm", "/v1/responses"), ("llamacpp", "/v1/chat/completions")])
def test_the_upstreams_flavor_chooses_native_or_translated(start, flavor, upstream_path):
    [engine], proxy = start(upstream_flavor=flavor)
    status, _, _ = _request(proxy, "POST", "/episodes/fl/v1/responses",
                            {"Content-Type": "application/json"},
                            b'{"model": "m", "input": "hi"}')
    assert status == 200
    assert [p for _, p, _, _ in engine.from_agent()] == [upstream_path]


@pytest.mark.parametrize(("method", "path", "named"), [
    ("DELETE", "/episodes/rf/v1/models/m", "DELETE /v1/models/m"),
    ("POST", "/episodes/rf", "POST /"),
    ("PUT", "/v1/chat/completions", "PUT /v1/chat/completions"),
])
def test_a_refusal_names_the_method_and_the_path_the_agent_asked_for(start, method, path,
                                                                      named):
    [engine], proxy = start()
    status, _, body = _request(proxy, method, path)
    assert status == 404
    error = json.loads(body)["error"]
    assert error["code"] == "not_exposed"
    assert error["message"].startswith(f"{named} is not exposed by this proxy")
    assert [p for _, p, _, _ in engine.seen if "rf" in p or p.startswith("/v1/chat")] == []


@pytest.mark.parametrize(("path", "anthropic"), [
    ("/episodes/sh/v1/messages/..%2f..%2fsleep", True),
    ("/v1/messages/..%2f..%2fsleep", True),
    ("/episodes/sh/v1/chat/completions/..%2f..%2fsleep", False),
])
def test_a_path_refused_before_routing_gets_its_apis_error_shape(start, path, anthropic):
    """Decided from the path as it came, since it never got a checked one: under
    /v1/messages/ Anthropic's shape (its SDK reads no other), else OpenAI's."""
    [engine], proxy = start()
    status, _, body = _request(proxy, "POST", path, {"Content-Type": "application/json"},
                               b"{}")
    assert status == 400
    reply = json.loads(body)
    if anthropic:
        assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error"
    else:
        assert "type" not in reply and reply["error"]["code"] == "invalid_path"
    assert [p for _, p, _, _ in engine.seen if "sleep" in p] == []
