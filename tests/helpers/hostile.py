"""The untrusted agent's test bench (test_hostile_*.py): a logging upstream that records
every request reaching it, a proxy in front of it, requests sent byte for byte, and the
proxy's count of what it refused."""

from __future__ import annotations

import http.client
import json

import pytest
from aiohttp import web

from helpers.loop import free_port
from helpers.servers import Proxy, ProxyProcess
from tracetap.demo.engine import EngineConfig, make_engine_app
from tracetap.proxy.runtime.settings import Settings

SECRET = "sk-upstream-SECRET-77c1"  # the proxy's key for the upstream: never the agent's
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def seen() -> list[tuple[str, str, str]]:
    """(method, raw path, Authorization) of every request the upstream received."""
    return []


@pytest.fixture
def upstream(serve_app, seen) -> str:
    """The mock engine, recording every request in ``seen``."""

    @web.middleware
    async def record(request, handler):
        seen.append((request.method, request.raw_path, request.headers.get("Authorization", "")))
        return await handler(request)

    app = make_engine_app(EngineConfig(flavor="vllm"))
    app.middlewares.append(record)
    return serve_app(app) + "/v1"


@pytest.fixture
def hostile(loop_thread, upstream, tmp_path, migrated_sqlite):
    """A proxy in front of the logging upstream, with its own upstream key and one path
    allowed beyond the model API (``POST /v1/embeddings``)."""
    settings = Settings(upstream=upstream, db=migrated_sqlite(tmp_path / "h.db"),
                        data_dir=str(tmp_path / "data"), port=free_port(),
                        upstream_api_key=SECRET, upstream_flavor="vllm",
                        allow_path=["POST /v1/embeddings"])
    proxy = Proxy(loop_thread, settings).start()
    yield proxy
    proxy.stop()


@pytest.fixture
def bodies() -> list[tuple[str, dict]]:
    """(path, JSON body) of every model request the recording engine received."""
    return []


@pytest.fixture
def recording_engine(serve_app, bodies) -> str:
    """The mock vLLM engine, recording the body of every model request in ``bodies``
    (the proxy's own /tokenize asks are left out); its /v1 base URL."""

    @web.middleware
    async def record(request, handler):
        if request.method == "POST" and request.path.startswith("/v1/"):
            bodies.append((request.path, json.loads(await request.read())))
        return await handler(request)

    app = make_engine_app(EngineConfig(flavor="vllm"))
    app.middlewares.append(record)
    return serve_app(app) + "/v1"


def raw_request(proxy, method: str, path: str, headers: dict | None = None,
                body: bytes | None = None) -> tuple[int, dict]:
    """The exact bytes of the path and headers on the wire: no client normalises them
    first, and none is added but ``Content-Length`` (left out when ``headers`` set
    ``Transfer-Encoding``). ``proxy`` is in-process or a subprocess. The body decoded as
    JSON, or ``{"raw": text}`` (what an upstream answered, relayed as it came)."""
    port = proxy.port if isinstance(proxy, ProxyProcess) else proxy.settings.port
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        if body is not None and "Transfer-Encoding" not in (headers or {}):
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        reply = conn.getresponse()
        data = reply.read()
    finally:
        conn.close()
    try:
        return reply.status, json.loads(data)
    except ValueError:
        return reply.status, {"raw": data.decode(errors="replace")}


def refused_count(proxy, reason: str) -> float:
    """``tracetap_agent_refused_total`` for ``reason`` on an in-process proxy."""
    text = proxy.state.metrics.render().decode()
    for line in text.splitlines():
        if line.startswith(f'tracetap_agent_refused_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0
