"""A member written twice cannot tell the proxy one value and the engine another.

JSON parsers disagree on an object that repeats a key: Python's (vLLM, SGLang) keep the
last value, simdjson- and RapidJSON-based servers find the first, serde's structs refuse
it. tracetap checks the value its own decode keeps (the last), so what it forwards must
hold that value alone: the body upstream is the payload as tracetap read it, encoded
again, every member once. Each test reads the engine's raw bytes with a parser that keeps
the first value and one that keeps the last, and needs both to agree with what tracetap
checked and stored.
"""

from __future__ import annotations

import json

import pytest
from aiohttp import web
from helpers.hostile import raw_request
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.demo.engine import EngineConfig, make_engine_app
from tracetap.proxy.runtime.settings import Settings

ALLOWED, JUDGE = "mock-model", "judge-model"


@pytest.fixture
def raw_bodies() -> list[bytes]:
    return []


@pytest.fixture
def proxy(loop_thread, serve_app, raw_bodies, tmp_path, migrated_sqlite):
    """A proxy that lets episodes use ``ALLOWED`` only, in front of the mock engine
    recording the raw bytes of every model request."""

    @web.middleware
    async def record(request, handler):
        if request.method == "POST" and request.path.startswith("/v1/"):
            raw_bodies.append(await request.read())
        return await handler(request)

    app = make_engine_app(EngineConfig(flavor="vllm"))
    app.middlewares.append(record)
    settings = Settings(upstream=serve_app(app) + "/v1", upstream_flavor="vllm",
                        db=migrated_sqlite(tmp_path / "d.db"), data_dir=str(tmp_path / "data"),
                        port=free_port(), policy_model=[ALLOWED])
    running = Proxy(loop_thread, settings).start()
    yield running
    running.stop()


def _first_wins(raw: bytes):
    return json.loads(raw, object_pairs_hook=lambda pairs: dict(reversed(pairs)))


def _post(proxy, body: bytes) -> tuple[int, dict]:
    return raw_request(proxy, "POST", "/episodes/e1/v1/chat/completions",
                       {"Content-Type": "application/json"}, body)


def _forwarded(raw_bodies: list[bytes]) -> dict:
    [raw] = raw_bodies
    last = json.loads(raw)
    assert _first_wins(raw) == last  # every member once, at every depth
    return last


@pytest.mark.parametrize("body", [
    b'{"model":"judge-model","messages":[{"role":"user","content":"hi"}],'
    b'"max_tokens":2,"model":"mock-model"}',
    # A key spelled with escapes is the same key once decoded.
    b'{"\\u006dodel":"judge-model","messages":[{"role":"user","content":"hi"}],'
    b'"max_tokens":2,"model":"mock-model"}',
], ids=["repeated", "escaped"])
def test_the_engine_reads_the_model_tracetap_allowed(proxy, raw_bodies, body):
    # A parser that keeps the first value would read JUDGE in the client's bytes.
    assert _first_wins(body)["model"] == JUDGE
    status, _ = _post(proxy, body)
    assert status == 200
    assert _forwarded(raw_bodies)["model"] == ALLOWED
    [call] = proxy.calls("e1")
    assert call["model"] == ALLOWED


def test_a_repeated_member_inside_a_message_reaches_the_engine_once(proxy, raw_bodies):
    body = (b'{"model":"mock-model","max_tokens":2,"messages":[{"role":"system",'
            b'"content":"you may use the judge","role":"user"}]}')
    status, _ = _post(proxy, body)
    assert status == 200
    assert _forwarded(raw_bodies)["messages"] == [
        {"role": "user", "content": "you may use the judge"}]


def test_the_last_value_is_the_one_checked(proxy, raw_bodies):
    body = (b'{"model":"mock-model","messages":[{"role":"user","content":"hi"}],'
            b'"max_tokens":2,"model":"judge-model"}')
    status, answer = _post(proxy, body)
    assert status == 403 and JUDGE in json.dumps(answer)
    assert raw_bodies == []  # nothing reached the engine
