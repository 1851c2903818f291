"""The driver's own promises about a call's life (``ModelCall.run``, proxy/call/driver.py),
observed in the proxy's process: the in-flight gauge counts a call only while it runs,
a refusal or a bug is the client's error and a stored record (never a bare 500, and a
stream already begun is cut, not turned into an error), a call cancelled under it (the
proxy stopping) is stored as cut, the overhead header, the client's query string
reaches the upstream, and a finished call is freed at once (the relay's pointer back to
it is dropped, so no cycle waits for the cyclic collector)."""

from __future__ import annotations

import asyncio
import gc
import http.client
import json
import socket
import threading
import weakref

import openai
import pytest
from aiohttp import web
from helpers.chat_upstreams import chat_reply
from helpers.http import fetch
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.proxy.call.driver import ModelCall
from tracetap.proxy.call.relay import Relay
from tracetap.proxy.call.timings import Timings
from tracetap.proxy.runtime.settings import Settings
from tracetap.storage.integrity import cause_of

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def db_url(tmp_path, migrated_sqlite) -> str:
    """SQLite only: nothing here depends on the database."""
    return migrated_sqlite(tmp_path / "tracetap.db")


def _start(loop_thread, upstream: str, db_url: str, tmp_path, **extra) -> Proxy:
    settings = Settings(
        upstream=upstream,
        db=db_url,
        data_dir=str(tmp_path / "data"),
        port=free_port(),
        upstream_flavor="vllm",
        **extra,
    )
    return Proxy(loop_thread, settings).start()


@pytest.fixture
def proxy(loop_thread, engine, db_url, tmp_path):
    p = _start(loop_thread, engine.url, db_url, tmp_path)
    yield p
    p.stop()


def _client(proxy: Proxy, episode: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.episode_url(episode), api_key="x", max_retries=0)


def _inflight(proxy: Proxy) -> float:
    return proxy.state.metrics.inflight._value.get()


class Gated:
    """An upstream that answers a whole chat reply once the test lets it (``go``), and
    records the query string each request came with."""

    def __init__(self, loop_thread):
        self.loop_thread = loop_thread
        self.arrived = threading.Event()
        self.queries: list[str] = []
        self._go: asyncio.Event | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    def go(self) -> None:
        self.loop_thread.loop.call_soon_threadsafe(self._event().set)

    def _event(self) -> asyncio.Event:
        if self._go is None:
            self._go = asyncio.Event()
        return self._go

    async def chat(self, request: web.Request) -> web.Response:
        await request.read()
        self.queries.append(request.rel_url.raw_query_string)
        go = self._event()
        self.arrived.set()
        await go.wait()
        return web.json_response(
            {
                "id": "g",
                "object": "chat.completion",
                "model": "gated",
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "ok"},
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )


@pytest.fixture
def gated(loop_thread, serve_app):
    upstream = Gated(loop_thread)
    upstream.url = serve_app(upstream.app()) + "/v1"
    yield upstream
    upstream.go()  # a failed test must not leave the proxy waiting


def test_the_inflight_gauge_counts_a_call_while_it_runs_and_not_after(
    loop_thread, gated, db_url, tmp_path
):
    """1 while the call waits on the upstream, 0 once it has answered (kills the gauge
    never raised, never lowered, or lowered on entry); the pause gate's count too (a call
    never released would hold every later weight sync's drain)."""
    proxy = _start(loop_thread, gated.url, db_url, tmp_path)
    try:
        assert _inflight(proxy) == 0
        done: list[tuple[int, bytes]] = []
        url = proxy.episode_url("inflight") + "/chat/completions"
        thread = threading.Thread(
            target=lambda: done.append(fetch("POST", url, {"model": "gated", "messages": MESSAGES}))
        )
        thread.start()
        assert gated.arrived.wait(30)
        assert _inflight(proxy) == 1
        gated.go()
        thread.join(30)
        assert done and done[0][0] == 200
        assert _inflight(proxy) == 0
        assert proxy.state.gate.inflight == 0 and proxy.state.gate.idle
    finally:
        proxy.stop()


def test_a_call_cancelled_before_the_upstream_answers_is_stored_as_cut_without_a_status(
    loop_thread, gated, db_url, tmp_path, monkeypatch
):
    """The proxy stopping under a call that waits on the upstream (its handler
    cancelled, as aiohttp does past the drain timeout): the call is stored as cut, with
    no HTTP status (0: no answer came), counted as a 499, and leaves the gauge and the
    gate."""
    tasks: list[asyncio.Task] = []
    drive = ModelCall._drive

    async def spied_drive(self, *args):
        tasks.append(asyncio.current_task())
        return await drive(self, *args)

    monkeypatch.setattr(ModelCall, "_drive", spied_drive)
    proxy = _start(loop_thread, gated.url, db_url, tmp_path)
    try:
        url = proxy.episode_url("cancelled") + "/chat/completions"
        outcome: list[object] = []

        def call() -> None:
            try:
                outcome.append(fetch("POST", url, {"model": "gated", "messages": MESSAGES}))
            except OSError as exc:  # the connection is dropped with its handler
                outcome.append(exc)

        thread = threading.Thread(target=call)
        thread.start()
        assert gated.arrived.wait(30)
        [task] = tasks
        loop_thread.loop.call_soon_threadsafe(task.cancel)
        proxy.loop.run(asyncio.wait([task]))
        thread.join(30)
        assert outcome and not isinstance(outcome[0], tuple)  # no reply was sent
        [stored] = proxy.calls("cancelled")
        # Not "ok" (an answer, whatever its status): aiohttp cancels a handler only as the
        # proxy stops (never for a client gone), so the episode's reward cannot be trusted.
        assert (stored["status"], stored["error"]) == (
            "proxy_stopped", "cancelled before the reply was sent")
        assert stored["http_status"] == 0 and stored["upstream"] is None
        assert cause_of(stored["status"], stored["http_status"]) == "proxy_error"
        requests = proxy.state.metrics.requests
        assert requests.labels("chat_completions", "499")._value.get() == 1
        assert _inflight(proxy) == 0 and proxy.state.gate.inflight == 0
    finally:
        proxy.stop()


def test_a_calls_place_in_its_episode_is_its_arrival_not_its_end(
    loop_thread, serve_app, db_url, tmp_path
):
    """``seq`` counts a call's arrival in its own episode: a call the upstream holds
    past a later call of its episode keeps the first place, and a call of another
    episode in between counts in that episode alone."""
    held, release = threading.Event(), threading.Event()

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        if body["messages"][0]["content"] == "held":
            held.set()
            while not release.is_set():
                await asyncio.sleep(0.01)
        return web.json_response(chat_reply("ok"))

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    proxy = _start(loop_thread, serve_app(app) + "/v1", db_url, tmp_path)

    def body(text: str) -> dict:
        return {"model": "u", "messages": [{"role": "user", "content": text}]}

    try:
        url = proxy.episode_url("order") + "/chat/completions"
        first: list[tuple[int, bytes]] = []
        thread = threading.Thread(target=lambda: first.append(fetch("POST", url, body("held"))))
        thread.start()
        assert held.wait(30)
        other = proxy.episode_url("other") + "/chat/completions"
        assert fetch("POST", other, body("between"))[0] == 200
        assert fetch("POST", url, body("later"))[0] == 200
        release.set()
        thread.join(30)
        assert first and first[0][0] == 200
        places = {json.loads(c["request"])["messages"][0]["content"]: c["seq"]
                  for c in proxy.calls("order")}
        assert places == {"held": 0, "later": 1}
        assert [c["seq"] for c in proxy.calls("other")] == [0]
    finally:
        release.set()
        proxy.stop()


def test_the_clients_query_string_reaches_the_upstream(loop_thread, gated, db_url, tmp_path):
    """A captured call is sent to the upstream with the client's query, as it came."""
    gated.go()
    proxy = _start(loop_thread, gated.url, db_url, tmp_path)
    try:
        url = proxy.episode_url("query") + "/chat/completions?api-version=2024-06-01&x=a%20b"
        status, _ = fetch("POST", url, {"model": "gated", "messages": MESSAGES})
        assert status == 200
        assert gated.queries == ["api-version=2024-06-01&x=a%20b"]
        [call] = proxy.calls("query")
        assert call["upstream"] == gated.url  # the target that answered
    finally:
        proxy.stop()


def test_the_upstream_gets_the_clients_path_and_the_proxys_headers(
    loop_thread, serve_app, db_url, tmp_path
):
    """A native call goes upstream on the path the client called (as checked), with the
    proxy's key in place of the client's and asking for an uncompressed body (capture
    parses it); with ``--forward-client-auth`` and no key of its own, the client's key
    goes on."""
    seen: list[tuple[str, dict[str, str]]] = []

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        seen.append((request.path, dict(request.headers)))
        return web.json_response(chat_reply("ok"))

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/chat/completions/", chat)
    upstream = serve_app(app) + "/v1"
    body = {"model": "u", "messages": MESSAGES}
    client = {"Authorization": "Bearer sk-client", "Accept-Encoding": "gzip"}
    for episode, path, options in [
        ("own-key", "/chat/completions/", {"upstream_api_key": "sk-up"}),
        ("forwarded", "/chat/completions", {"forward_client_auth": True}),
    ]:
        proxy = _start(loop_thread, upstream, db_url, tmp_path / episode, **options)
        try:
            assert fetch("POST", proxy.episode_url(episode) + path, body, headers=client)[0] == 200
        finally:
            proxy.stop()
    (path, own), (_, forwarded) = seen
    assert path == "/v1/chat/completions/"
    assert (own["Authorization"], own["Accept-Encoding"]) == ("Bearer sk-up", "identity")
    assert forwarded["Authorization"] == "Bearer sk-client"


@pytest.mark.parametrize("header", [True, False], ids=["header", "no-header"])
def test_the_overhead_header_is_on_a_whole_reply_unless_turned_off(
    loop_thread, engine, db_url, tmp_path, header, monkeypatch
):
    """``x-tracetap-overhead-ms``: the proxy's own time on a whole reply, in
    milliseconds with three decimals; absent with ``--no-overhead-header``."""
    proxy = _start(loop_thread, engine.url, db_url, tmp_path, overhead_header=header)
    # The proxy's own time, fixed (what it is cannot be known from outside): the header
    # is it in milliseconds.
    monkeypatch.setattr(Timings, "overhead", lambda self, elapsed=None: 0.0123456)
    try:
        with _client(proxy, "overhead") as client:
            raw = client.chat.completions.with_raw_response.create(
                model="mock-model", messages=MESSAGES
            )
        value = raw.headers.get("x-tracetap-overhead-ms")
        if not header:
            assert value is None
        else:
            assert value == "12.346"
    finally:
        proxy.stop()


def test_a_bad_request_is_the_clients_400_and_a_stored_refusal(proxy):
    status, body = fetch("POST", proxy.episode_url("bad") + "/chat/completions", b"{nope")
    assert status == 400
    error = json.loads(body)["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    [call] = proxy.calls("bad")
    assert (call["status"], call["http_status"]) == ("bad_request", 400)
    assert call["error"] == error["message"]
    # Refused before admission and before the upstream: no version stamped, no upstream,
    # and the pause gate, never entered, is not left.
    assert (call["policy_version"], call["upstream"], call["overlay"]) == (None, None, None)
    assert proxy.state.gate.inflight == 0


def test_an_agents_call_on_anothers_episode_is_refused_and_counted_by_its_reason(proxy):
    """A registered episode called without its key, or with another episode's: a 403,
    counted in ``tracetap_agent_refused_total`` by the refusal's code."""
    _, mine = proxy.admin("POST", "/tracetap/episodes", {"id": "mine"})
    proxy.admin("POST", "/tracetap/episodes", {"id": "theirs"})
    body = {"model": "mock-model", "messages": MESSAGES}
    url = proxy.url + "/episodes/theirs/v1/chat/completions"  # its id, not its key
    assert fetch("POST", url, body)[0] == 403
    assert fetch("POST", url, body, token=mine["api_key"])[0] == 403
    refused = proxy.state.metrics.refused
    assert refused.labels("episode_credential_required")._value.get() == 1
    assert refused.labels("forbidden")._value.get() == 1


def test_the_harness_lineage_names_are_stored_with_the_call(proxy):
    """``X-Tracetap-Lineage`` and ``X-Tracetap-Parent`` name the call's conversation
    and the one that started it (proxy.lineage), on its record."""
    headers = {"X-Tracetap-Lineage": "sub-1", "X-Tracetap-Parent": "main"}
    url = proxy.episode_url("named") + "/chat/completions"
    assert fetch("POST", url, {"model": "mock-model", "messages": MESSAGES},
                 headers=headers)[0] == 200
    [call] = proxy.calls("named")
    assert (call["lineage"], call["parent_lineage"]) == ("sub-1", "main")


def test_a_stalled_request_body_is_the_clients_408_and_a_stored_refusal(
    loop_thread, engine, db_url, tmp_path
):
    """``--body-timeout``: a client that stops sending its body is answered 408, and the
    call is stored with that status (the upstream never asked)."""
    proxy = _start(loop_thread, engine.url, db_url, tmp_path, body_timeout=0.3)
    try:
        with socket.create_connection(("127.0.0.1", proxy.settings.port), timeout=10) as sock:
            sock.sendall(b"POST /episodes/stalled/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                         b'{"model":')
            reply = http.client.HTTPResponse(sock)
            reply.begin()
            assert reply.status == 408
            assert json.loads(reply.read())["error"]["code"] == "request_timeout"
            sock.sendall(b" " * 91)  # the rest, which aiohttp waits for before it lets go
        [call] = proxy.calls("stalled")
        assert call["http_status"] == 408 and call["upstream"] is None
    finally:
        proxy.stop()


def test_a_bug_before_the_reply_is_a_500_in_the_clients_shape_and_stored(proxy, monkeypatch):
    """Never a bare 500: a bug before anything was relayed is the client's internal
    error, counted, and the call is stored as an error."""

    async def broken(self):
        raise RuntimeError("a bug")

    monkeypatch.setattr(ModelCall, "admit", broken)
    status, body = fetch(
        "POST",
        proxy.episode_url("bug") + "/chat/completions",
        {"model": "mock-model", "messages": MESSAGES},
    )
    assert status == 500
    error = json.loads(body)["error"]
    assert "RuntimeError" in error["message"] and error["code"] == "internal_error"
    [call] = proxy.calls("bug")
    assert call["call_id"] in error["message"]  # the id the log's traceback is under
    assert (call["status"], call["http_status"]) == ("error", 500)
    assert "RuntimeError" in call["error"]
    assert proxy.state.metrics.internal_errors._value.get() == 1


def test_a_bug_mid_stream_cuts_the_clients_stream_and_is_stored_as_an_error(proxy, monkeypatch):
    """Once the client's stream has begun its reply cannot become an error: the stream
    is cut, and the record says why (status error, the bug's message)."""
    read = Relay.chunk  # every upstream read of a stream passes here
    seen = []

    def breaks_on_the_fourth(self, data):
        seen.append(data)
        if len(seen) == 4:
            raise RuntimeError("a bug mid-stream")
        return read(self, data)

    monkeypatch.setattr(Relay, "chunk", breaks_on_the_fourth)
    chunks = []
    gc.collect()
    gc.disable()  # what the bug left behind must go as the call ends, not when collected
    try:
        with _client(proxy, "midbug") as client, pytest.raises(openai.APIError):
            for chunk in client.chat.completions.create(
                model="mock-model",
                messages=MESSAGES,
                stream=True,
                extra_body={"mock_completion_tokens": 20, "mock_chunk_delay_s": 0.01},
            ):
                chunks.append(chunk)
        assert 0 < len(chunks) < 20
        [call] = proxy.calls("midbug")
        proxy.loop.run(asyncio.sleep(0.05))
        # The stream's weight-sync cut left the gate: a pause would otherwise cut a
        # call that is long over, and the gate would hold the call's buffers meanwhile.
        assert not proxy.state.gate.cuts
    finally:
        gc.enable()
    assert call["status"] == "error" and "RuntimeError" in call["error"]
    assert call["http_status"] == 200  # the client's stream had begun


@pytest.mark.parametrize("stream", [False, True])
def test_a_finished_call_is_freed_without_the_cyclic_collector(proxy, monkeypatch, stream):
    """The relay points back at its call; ``finish`` drops that pointer so the call's
    context-sized buffers are freed by reference counting as the handler returns, not
    when the cyclic collector next runs (disabled here to tell the two apart)."""
    calls: list[weakref.ref] = []
    init = ModelCall.__init__

    def spied_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        calls.append(weakref.ref(self))

    monkeypatch.setattr(ModelCall, "__init__", spied_init)
    gc.collect()
    gc.disable()
    try:
        with _client(proxy, "freed") as client:
            if stream:
                for _ in client.chat.completions.create(
                    model="mock-model", messages=MESSAGES, stream=True
                ):
                    pass
            else:
                client.chat.completions.create(model="mock-model", messages=MESSAGES)
        proxy.flush()
        proxy.loop.run(asyncio.sleep(0.05))  # the metrics callback (call_soon) has run
        [ref] = calls
        assert ref() is None, gc.get_referrers(ref())
    finally:
        gc.enable()


@pytest.mark.parametrize("stream", [False, True])
def test_the_client_gets_the_upstreams_status_and_content_type(proxy, stream):
    """The reply's status and headers are the upstream's (a whole reply and a stream)."""
    url = proxy.episode_url(f"refused-{stream}") + "/chat/completions"
    body = {"model": "mock-model", "messages": MESSAGES, "stream": stream}
    status, error = fetch("POST", url, {**body, "mock_status": 429})
    assert status == 429
    # A JSON error, streamed or not, is a whole reply: stored as the client got it.
    [call] = proxy.calls(f"refused-{stream}")
    assert call["http_status"] == 429 and call["response"].encode() == error
    with _client(proxy, "headers") as client:
        if stream:
            with client.chat.completions.with_streaming_response.create(
                model="mock-model", messages=MESSAGES, stream=True
            ) as response:
                content_type = response.headers["content-type"]
                assert b"".join(response.iter_bytes()).endswith(b"data: [DONE]\n\n")
        else:
            content_type = client.chat.completions.with_raw_response.create(
                model="mock-model", messages=MESSAGES
            ).headers["content-type"]
    expected = "text/event-stream" if stream else "application/json"
    assert content_type.split(";")[0] == expected


def test_an_event_stream_keeps_the_upstreams_error_status(loop_thread, serve_app, db_url,
                                                           tmp_path):
    """An upstream that answers an error as an event stream: the client gets its status
    with its events, and the record its status."""
    error = b'data: {"error":{"message":"overloaded","code":503}}\n\n'

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(status=503, headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(error)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    proxy = _start(loop_thread, serve_app(app) + "/v1", db_url, tmp_path)
    try:
        url = proxy.episode_url("sse-error") + "/chat/completions"
        body = {"model": "u", "messages": MESSAGES, "stream": True}
        assert fetch("POST", url, body) == (503, error)
        [call] = proxy.calls("sse-error")
        assert call["http_status"] == 503
    finally:
        proxy.stop()


def _unterminated_upstream() -> web.Application:
    """A chat stream whose last event, ``data: [DONE]``, lacks its closing blank line:
    the upstream closes the connection right after it."""

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, word in enumerate(["one", " two"]):
            chunk = {
                "id": "u",
                "object": "chat.completion.chunk",
                "model": "u",
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": word},
                        "token_ids": [i],
                        "logprobs": {"content": [{"token": word, "logprob": -0.5}]},
                        "finish_reason": None if i == 0 else "stop",
                    }
                ],
            }
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


# What the client asks for itself: everything tracetap would add (its stream is relayed
# as it came), or nothing (rewritten).
EVERYTHING = {"logprobs": True, "top_logprobs": 0, "extra_body": {"return_token_ids": True},
              "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("asks", [{}, EVERYTHING], ids=["rewritten", "relayed"])
def test_an_unterminated_last_event_still_reaches_the_client_and_the_record(
    loop_thread, serve_app, db_url, tmp_path, asks
):
    """The stream's end is seen when the upstream closes (``Relay.end``): the client
    still gets [DONE] (a relayed stream: as the upstream sent it, nothing after it), and
    the call is stored whole."""
    proxy = _start(loop_thread, serve_app(_unterminated_upstream()) + "/v1", db_url, tmp_path)
    try:
        client = _client(proxy, "unterminated")
        with (
            client,
            client.chat.completions.with_streaming_response.create(
                model="u", messages=MESSAGES, stream=True, **asks
            ) as response,
        ):
            raw = b"".join(response.iter_bytes())
        assert raw.rstrip().endswith(b"data: [DONE]")
        if asks:
            assert raw.endswith(b"data: [DONE]")
        [call] = proxy.calls("unterminated")
        assert call["status"] == "ok"
        assert call["choices"][0]["text"] == "one two"
    finally:
        proxy.stop()


def test_a_call_refused_before_it_is_tagged_is_stored_without_an_episode(
    loop_thread, engine, db_url, tmp_path
):
    """``--require-episode`` refuses an untagged call before it has an episode: its
    record has none (NULL, not an empty id), and an arrival order given when the record
    is built."""
    proxy = _start(loop_thread, engine.url, db_url, tmp_path, require_episode=True)
    try:
        status, _ = fetch("POST", proxy.url + "/v1/chat/completions",
                          {"model": "mock-model", "messages": MESSAGES})
        assert status == 400
        [call] = proxy.calls(None)
        assert call["status"] == "bad_request"
        assert call["episode_id"] is None and call["seq"] == 0
    finally:
        proxy.stop()
