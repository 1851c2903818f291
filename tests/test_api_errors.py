"""Each wire API's errors come back in that API's shape: the proxy's own refusals
(400/403/404/413/429/502/504), read by the real openai and anthropic SDKs.

The client's API decides the shape, once per request from its route
(``proxy.apis.routing.client_errors``); ``proxy/apis/chat/errors.py`` and
``proxy/apis/messages/errors.py`` are the one place each shape is written."""

from __future__ import annotations

import asyncio
import errno
import json
import threading

import anthropic
import openai
import pytest
from aiohttp import web
from anthropic.types import ErrorResponse
from helpers.loop import free_port
from helpers.servers import Proxy
from sqlalchemy import event

from tracetap.migrations import upgrade
from tracetap.proxy.apis.chat.errors import OPENAI_ERRORS
from tracetap.proxy.apis.messages import translate as messages_translate
from tracetap.proxy.apis.messages.errors import ANTHROPIC_ERRORS
from tracetap.proxy.apis.routing import client_errors
from tracetap.proxy.http.errors import ProxyError
from tracetap.proxy.runtime.settings import Settings

APIS = ("chat", "completions", "responses", "messages")
# Anthropic's error types by status, as the SDK's error models know them.
ANTHROPIC_TYPES = {400: "invalid_request_error", 403: "permission_error",
                   404: "not_found_error", 413: "invalid_request_error",
                   429: "rate_limit_error", 502: "api_error", 503: "overloaded_error",
                   504: "timeout_error"}


@pytest.fixture
def start_proxy(loop_thread, tmp_path):
    started: list[Proxy] = []

    def start(upstream: str, **settings) -> Proxy:
        db = f"sqlite:///{tmp_path / f'p{len(started)}.db'}"
        upgrade(db)
        started.append(Proxy(loop_thread, Settings(
            upstream=upstream, db=db, data_dir=str(tmp_path / f"d{len(started)}"),
            port=free_port(), upstream_flavor="openai", **settings)).start())
        return started[-1]

    yield start
    for proxy in started:
        proxy.stop()


def _refused(api: str, base: str, *, headers: dict | None = None, text: str = "hi",
             **extra) -> openai.APIStatusError | anthropic.APIStatusError:
    """One call of ``api`` through the SDK that speaks it; the error it raised."""
    if api == "messages":
        client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=30,
                                     default_headers=headers)
        with client, pytest.raises(anthropic.APIStatusError) as caught:
            client.messages.create(model="m", max_tokens=1000, extra_body=extra or None,
                                   messages=[{"role": "user", "content": text}])
        return caught.value
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30,
                           default_headers=headers)
    with client, pytest.raises(openai.APIStatusError) as caught:
        if api == "chat":
            client.chat.completions.create(model="m", max_tokens=1000, extra_body=extra or None,
                                           messages=[{"role": "user", "content": text}])
        elif api == "completions":
            client.completions.create(model="m", max_tokens=1000, prompt=text,
                                      extra_body=extra or None)
        else:
            client.responses.create(model="m", max_output_tokens=1000, input=text,
                                    extra_body=extra or None)
    return caught.value


def _assert_shape(api: str, error, status: int, code: str | None = None) -> dict:
    """The body is exactly the client API's error shape; returns its inner error."""
    assert error.status_code == status
    body = error.response.json()
    if api == "messages":
        assert isinstance(error, anthropic.APIStatusError)
        assert set(body) == {"type", "error"} and body["type"] == "error"
        assert set(body["error"]) == {"type", "message"}
        assert body["error"]["type"] == ANTHROPIC_TYPES[status]
        ErrorResponse.model_validate(body)  # the SDK's own model of an error body
    else:
        assert isinstance(error, openai.APIStatusError)
        assert set(body) == {"error"}
        assert set(body["error"]) == {"message", "type", "param", "code"}
        if code is not None:
            assert body["error"]["code"] == code
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


@pytest.fixture
def refusing(start_proxy, engine):
    """A proxy that refuses bodies over 2 KiB."""
    return start_proxy(engine.url, max_body=2048)


@pytest.mark.parametrize("api", APIS)
def test_refusals_come_in_the_clients_shape(refusing, api):
    base = refusing.url + "/episodes/e1"
    # 400: an episode id the proxy cannot take (tagged by header)
    error = _refused(api, refusing.url, headers={"X-Tracetap-Episode": "no spaces allowed"})
    _assert_shape(api, error, 400, "invalid_episode_id")
    # 403: a registered episode called without its key
    status, _ = refusing.admin("POST", "/tracetap/episodes", {"id": f"reg-{api}"})
    assert status == 201
    error = _refused(api, f"{refusing.url}/episodes/reg-{api}")
    _assert_shape(api, error, 403, "episode_credential_required")
    # 413: a body over the proxy's limit
    _assert_shape(api, _refused(api, base, text="x" * 4096), 413, "request_too_large")
    [call] = refusing.calls("e1")  # stored with the status its client was given
    assert call["http_status"] == 413 and call["status"] == "bad_request"


def test_paths_not_exposed_are_404_in_the_shape_of_the_sdk_that_asked(refusing):
    client = openai.OpenAI(base_url=refusing.url + "/episodes/e2/v1", api_key="x",
                           max_retries=0, timeout=30)
    with client, pytest.raises(openai.NotFoundError) as caught:
        client.files.list()
    _assert_shape("chat", caught.value, 404, "not_exposed")
    agent = anthropic.Anthropic(base_url=refusing.url + "/episodes/e2", api_key="x",
                                max_retries=0, timeout=30)
    with agent, pytest.raises(anthropic.NotFoundError) as caught:
        agent.messages.batches.list()  # under /v1/messages, yet not exposed
    _assert_shape("messages", caught.value, 404)


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_an_untranslatable_request_is_a_400_naming_its_param(refusing, api):
    extra = ({"mcp_servers": [{"type": "url", "name": "m", "url": "http://x"}]}
             if api == "messages" else {"previous_response_id": "resp_1"})
    error = _assert_shape(api, _refused(api, refusing.url + "/episodes/e3", **extra), 400,
                          "unsupported_parameter")
    param = "mcp_servers" if api == "messages" else "previous_response_id"
    assert param in error["message"]
    if api == "responses":  # OpenAI's shape names it as the param too
        assert error["param"] == param
    [call] = refusing.calls("e3")
    assert call["status"] == "bad_request" and call["http_status"] == 400


@pytest.mark.parametrize("api", APIS)
def test_an_unreachable_upstream_is_a_502_in_the_clients_shape(start_proxy, api):
    proxy = start_proxy(f"http://127.0.0.1:{free_port()}/v1")
    error = _refused(api, proxy.url + "/episodes/down")
    _assert_shape(api, error, 502, "upstream_unreachable")


@pytest.fixture
def holding_upstream(serve_app):
    """An upstream that holds each call until ``release`` is set (then answers 500);
    ``arrived`` is set when a call reaches it."""
    arrived, release = threading.Event(), asyncio.Event()

    async def hold(request: web.Request) -> web.Response:
        if request.method != "POST" or not request.path.startswith("/v1/"):
            return web.json_response({}, status=404)  # health checks, tokenizer probes
        arrived.set()
        await release.wait()
        return web.json_response({"error": {"message": "released"}}, status=500)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hold)
    return serve_app(app) + "/v1", arrived, release


@pytest.mark.parametrize("api", APIS)
def test_a_budget_held_by_a_call_in_flight_is_a_429_in_the_clients_shape(
        start_proxy, holding_upstream, loop_thread, api):
    upstream, arrived, release = holding_upstream
    proxy = start_proxy(upstream, episode_max_tokens=64)
    base = proxy.url + "/episodes/held"
    first = threading.Thread(target=lambda: _refused(api, base))  # holds 1000+ tokens
    first.start()
    try:
        assert arrived.wait(30)
        _assert_shape(api, _refused(api, base), 429, "episode_budget_reserved")
    finally:
        loop_thread.loop.call_soon_threadsafe(release.set)
        first.join(30)


@pytest.mark.parametrize("api", APIS)
def test_a_budget_ledger_outage_is_a_503_with_retry_in_the_clients_shape(
        start_proxy, holding_upstream, loop_thread, api):
    """The ledger's storage gone (a bare OSError, no SQLAlchemy wrapper): the call is
    refused with 503 and Retry-After, never a 500 and never let through unbudgeted."""
    upstream, arrived, release = holding_upstream
    proxy = start_proxy(upstream, episode_max_calls=5)
    ledger = proxy.state.engine
    down = threading.Event()

    @event.listens_for(ledger.sync_engine, "checkout")  # each use of a connection
    def refuse(*_):
        if down.is_set():
            raise OSError(errno.EIO, "Input/output error")

    down.set()
    try:
        error = _refused(api, proxy.url + "/episodes/ledger-down")
    finally:
        down.clear()  # the writer stores the refused call once the storage is back
    inner = _assert_shape(api, error, 503, "budget_unavailable")
    assert inner["message"] == ("the episode's budget could not be checked: "
                                "[Errno 5] Input/output error")
    assert error.response.headers["Retry-After"] == "5"
    assert not arrived.is_set()  # the upstream never saw the call
    loop_thread.loop.call_soon_threadsafe(release.set)


@pytest.mark.parametrize("api", APIS)
def test_an_upstream_timeout_is_a_504_in_the_clients_shape(start_proxy, holding_upstream,
                                                             loop_thread, api):
    upstream, _, release = holding_upstream
    proxy = start_proxy(upstream, upstream_timeout=0.3)
    try:
        error = _refused(api, proxy.url + "/episodes/slow")
    finally:
        loop_thread.loop.call_soon_threadsafe(release.set)
    _assert_shape(api, error, 504, "upstream_timeout")


def test_the_shape_is_decided_by_the_clients_api_not_a_path_sniff():
    anthropic_client = {"anthropic-version": "2023-06-01"}
    assert client_errors("/v1/messages", {}) is ANTHROPIC_ERRORS
    assert client_errors("/v1/messages/count_tokens", {}) is ANTHROPIC_ERRORS
    assert client_errors("/v1/models", anthropic_client) is ANTHROPIC_ERRORS
    # A captured path's API decides, whatever the headers; OpenAI's Assistants paths
    # that end in /messages are OpenAI's.
    assert client_errors("/v1/chat/completions", anthropic_client) is OPENAI_ERRORS
    assert client_errors("/v1/responses", {}) is OPENAI_ERRORS
    assert client_errors("/v1/threads/t1/messages", {}) is OPENAI_ERRORS
    assert client_errors("/v1/files", {}) is OPENAI_ERRORS


@pytest.mark.parametrize("status", sorted(ANTHROPIC_TYPES))
def test_one_anthropic_status_map_for_refusals_and_upstream_errors(status):
    """A refusal of the proxy's own and an upstream's error of the same status read the
    same type (there used to be two maps that differed, e.g. on 413 and 504)."""
    own = json.loads(ANTHROPIC_ERRORS.body(ProxyError(status, "m")))
    upstream = json.loads(messages_translate.error_from_chat(status, b'{"message":"m"}'))
    assert own == upstream == {"type": "error",
                               "error": {"type": ANTHROPIC_TYPES[status], "message": "m"}}
    ErrorResponse.model_validate(own)
