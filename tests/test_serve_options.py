"""`tracetap serve` options: --require-episode, --forward-client-auth, and SIGINT."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from aiohttp import web
from helpers.http import post
from helpers.loop import free_port
from helpers.servers import Proxy, stored_calls

from tracetap.demo.engine import EngineConfig, make_engine_app
from tracetap.migrations import upgrade
from tracetap.proxy.runtime.settings import Settings

MESSAGES = [{"role": "user", "content": "hi"}]


def _recording_engine(seen: list[str | None]) -> web.Application:
    """The mock engine, noting the Authorization header of every request it gets."""

    @web.middleware
    async def record(request, handler):
        seen.append(request.headers.get("Authorization"))
        return await handler(request)

    app = make_engine_app(EngineConfig())
    app.middlewares.append(record)
    return app


@pytest.fixture
def db_url(tmp_path) -> str:
    """SQLite only: what is checked here does not depend on the database (the storage
    tests run on both)."""
    url = f"sqlite:///{tmp_path / 'tracetap.db'}"
    upgrade(url)
    return url


@pytest.fixture
def start_proxy(loop_thread, db_url, tmp_path):
    started: list[Proxy] = []

    def start(upstream: str, **options) -> Proxy:
        settings = Settings(upstream=upstream, db=db_url, data_dir=str(tmp_path / "d"),
                            port=free_port(), upstream_flavor="vllm", **options)
        started.append(Proxy(loop_thread, settings).start())
        return started[-1]

    yield start
    for proxy in started:
        proxy.stop()


def test_require_episode_refuses_untagged_calls_and_records_the_refusal(start_proxy, engine):
    proxy = start_proxy(engine.url, require_episode=True)
    untagged = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    tagged = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0,
                           default_headers={"X-Tracetap-Episode": "tagged"})
    with untagged, tagged:
        with pytest.raises(openai.BadRequestError) as info:
            untagged.chat.completions.create(model="mock-model", messages=MESSAGES)
        tagged.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=2)
    assert info.value.body["code"] == "episode_required"
    assert "X-Tracetap-Episode" in info.value.body["message"]
    [refused] = proxy.calls(None)  # refused, and still on record
    assert (refused["status"], refused["http_status"]) == ("bad_request", 400)
    assert "requires an episode" in refused["error"]
    assert [c["status"] for c in proxy.calls("tagged")] == ["ok"]


def test_forward_client_auth_passes_the_clients_key_never_an_episode_key(
        start_proxy, serve_app):
    seen: list[str | None] = []
    upstream = serve_app(_recording_engine(seen)) + "/v1"
    forwarding = start_proxy(upstream, forward_client_auth=True)
    own = openai.OpenAI(base_url=forwarding.episode_url("fwd"), api_key="sk-client-own",
                        max_retries=0)
    with own:
        own.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=2)
        own.models.list()  # relayed paths forward it too
    assert seen == ["Bearer sk-client-own"] * 2

    status, created = forwarding.admin("POST", "/tracetap/episodes", {"id": "k"})
    assert status == 201, created
    key = created["api_key"]
    seen.clear()
    with openai.OpenAI(base_url=forwarding.url + "/v1", api_key=key, max_retries=0) as agent:
        agent.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=2)
    assert seen == [None]  # tracetap's own credential stops at tracetap

    proxy_key = start_proxy(upstream, forward_client_auth=True, upstream_api_key="sk-proxy")
    seen.clear()
    with openai.OpenAI(base_url=proxy_key.episode_url("fwd"), api_key="sk-client-own",
                       max_retries=0) as client:
        client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=2)
    assert seen == ["Bearer sk-proxy"]  # the proxy's upstream key wins

    without = start_proxy(upstream)
    seen.clear()
    with openai.OpenAI(base_url=without.episode_url("fwd"), api_key="sk-client-own",
                       max_retries=0) as client:
        client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=2)
    assert seen == [None]  # the default: the client's key is not the upstream's business


def test_the_flags_on_the_command_line_and_sigint_drains_then_exits_zero(
        serve_app, fresh_postgres, run_proxy):
    upgrade(fresh_postgres)
    seen: list[str | None] = []
    upstream = serve_app(_recording_engine(seen)) + "/v1"
    proxy = run_proxy(upstream, fresh_postgres, "--require-episode", "--forward-client-auth",
                      "--drain-timeout", "20")
    status, refused = post(proxy.url + "/v1/chat/completions",
                           {"model": "mock-model", "messages": MESSAGES})
    assert status == 400
    assert refused["error"]["code"] == "episode_required"

    started = threading.Barrier(3)

    def stream(i: int) -> list:
        client = openai.OpenAI(base_url=proxy.episode_url("sigint"), api_key="sk-client-own",
                               max_retries=0)
        with client:
            chunks = []
            for chunk in client.chat.completions.create(
                    model="mock-model", messages=[{"role": "user", "content": f"s{i}"}],
                    stream=True, extra_body={"mock_completion_tokens": 30,
                                             "mock_chunk_delay_s": 0.03}):
                if not chunks:
                    started.wait(10)
                chunks.append(chunk)
            return chunks

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(stream, i) for i in range(2)]
        started.wait(10)
        proxy.signal(signal.SIGINT)  # Ctrl-C: the streams in flight still finish
        results = [f.result(30) for f in futures]
    assert proxy.wait(30) == 0
    assert all(chunks[-1].choices[0].finish_reason for chunks in results)
    assert "Bearer sk-client-own" in seen
    calls = stored_calls(fresh_postgres, "sigint")
    assert len(calls) == 2
    assert all(c["status"] == "ok" and len(c["choices"][0]["completion_ids"]) == 30
               for c in calls)
    assert [c["http_status"] for c in stored_calls(fresh_postgres, None)] == [400]
