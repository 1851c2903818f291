"""Who may do what: admin token, per-episode keys, registered ids, and the upstream key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from aiohttp import web
from helpers.http import request_json
from helpers.loop import free_port
from helpers.servers import Forwarder, Proxy, stored_calls

from tracetap.demo.engine import EngineConfig, make_engine_app
from tracetap.migrations import upgrade
from tracetap.proxy.runtime.settings import Settings

SECRET = "sk-upstream-SECRET-3f9a1c"
CONTENT = "what the lighthouse keeper said, 41c7"  # findable in any dump
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def guarded(loop_thread, engine, db_url, tmp_path):
    settings = Settings(upstream=engine.url, db=db_url, data_dir=str(tmp_path / "d"),
                        port=free_port(), admin_token="admin-T", require_registered=True)
    proxy = Proxy(loop_thread, settings).start()
    yield proxy
    proxy.stop()


def test_admin_api_needs_the_admin_token(guarded):
    url = guarded.url + "/tracetap/episodes"
    assert request_json("POST", url, {"id": "a"})[0] == 401
    assert request_json("POST", url, {"id": "a"}, token="wrong")[0] == 401
    assert request_json("GET", url)[0] == 401
    assert request_json("PUT", guarded.url + "/tracetap/policy", {"version": "v"})[0] == 401
    assert request_json("POST", url, {"id": "a"}, token="admin-T")[0] == 201
    assert request_json("GET", url, token="admin-T")[0] == 200


def test_an_episode_key_tags_only_its_own_episode(guarded):
    admin = "admin-T"
    _, a = request_json("POST", guarded.url + "/tracetap/episodes", {"id": "ep-a"}, token=admin)
    request_json("POST", guarded.url + "/tracetap/episodes", {"id": "ep-b"}, token=admin)
    key_a = a["api_key"]

    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=key_a, max_retries=0)
    into_b = openai.OpenAI(base_url=guarded.episode_url("ep-b"), api_key=key_a, max_retries=0)
    via_header = openai.OpenAI(base_url=guarded.url + "/v1", api_key=key_a, max_retries=0,
                               default_headers={"X-Tracetap-Episode": "ep-b"})
    with client, into_b, via_header:
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
        for other in (into_b, via_header):
            with pytest.raises(openai.PermissionDeniedError):
                other.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    # The key cannot read or administer anything, even its own episode.
    assert request_json("GET", guarded.url + "/tracetap/episodes", token=key_a)[0] == 403
    assert request_json("GET", guarded.url + "/tracetap/episodes/ep-a", token=key_a)[0] == 403
    assert request_json("POST", guarded.url + "/tracetap/episodes", {}, token=key_a)[0] == 403
    assert request_json("POST", guarded.url + "/tracetap/episodes/ep-b/finish", {"reward": 1},
                    token=key_a)[0] == 403
    # Nor grade itself: rewards come from the operator's grader, with the admin token.
    assert request_json("POST", guarded.url + "/tracetap/episodes/ep-a/finish", {"reward": 1},
                    token=key_a)[0] == 403
    assert len(guarded.calls("ep-a")) == 1
    assert guarded.calls("ep-b") == []  # refused calls are recorded untagged, not in B
    assert [c["http_status"] for c in guarded.calls(None)] == [403, 403]
    assert request_json("GET", guarded.url + "/tracetap/episodes/ep-b", token=admin)[1][
        "finished_at"] is None


def test_unknown_keys_and_unregistered_episodes_are_refused(guarded):
    bad_key = openai.OpenAI(base_url=guarded.url + "/v1", api_key="tt-forged", max_retries=0)
    unregistered = openai.OpenAI(base_url=guarded.episode_url("nobody"), api_key="x",
                                 max_retries=0)
    with bad_key, unregistered:
        with pytest.raises(openai.AuthenticationError):
            bad_key.chat.completions.create(model="m", messages=MESSAGES)
        with pytest.raises(openai.NotFoundError):
            unregistered.chat.completions.create(model="m", messages=MESSAGES)


def test_serve_refuses_a_public_bind_without_an_admin_token(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "tracetap", "serve", "--upstream", "http://127.0.0.1:9/v1",
         "--host", "0.0.0.0", "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 2
    assert "--admin-token" in result.stderr


def _recording_engine(seen: list[str]) -> web.Application:
    @web.middleware
    async def record(request, handler):
        seen.append(request.headers.get("Authorization", ""))
        return await handler(request)

    app = make_engine_app(EngineConfig())
    app.middlewares.append(record)
    return app


def test_upstream_key_reaches_only_the_upstream(serve_app, fresh_postgres, run_proxy,
                                                loop_thread, tmp_path):
    upgrade(fresh_postgres)
    seen: list[str] = []
    upstream = serve_app(_recording_engine(seen))
    database = Forwarder(loop_thread, free_port())
    database.start()
    proxy = run_proxy(upstream + "/v1", database.route(fresh_postgres),
                      env={"TRACETAP_UPSTREAM_API_KEY": SECRET, "TRACETAP_LOG_LEVEL": "DEBUG"})
    try:
        # With the database away, every record waits in the journal, where it can be read.
        database.cut()
        client = openai.OpenAI(base_url=proxy.episode_url("secret"), api_key="sk-client-own",
                               max_retries=0)
        messages = [{"role": "user", "content": CONTENT}]
        with client:
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=4)
            stream = list(client.chat.completions.create(model="m", messages=messages,
                                                         max_tokens=4, stream=True))
            client.models.list()
        assert SECRET not in reply.model_dump_json() and stream
        assert seen and set(seen) == {f"Bearer {SECRET}"}  # the client's own key never passed
        journal = b"".join(p.read_bytes()
                           for p in Path(tmp_path / "data" / "journal").glob("*.seg"))
        assert journal.count(CONTENT.encode()) >= 2  # both calls are in there...
        database.start()
        proxy.stop()
    finally:
        database.cut()
    calls = stored_calls(fresh_postgres, "secret")
    assert len(calls) == 2  # stop() flushed them
    # Bodies are stored as compressed blocks, so the raw dump is searched too, and the
    # stored bodies as tracetap reads them back (where CONTENT shows the check sees data).
    stored = json.dumps(calls)
    assert stored.count(CONTENT) >= 2
    dump = subprocess.run(["pg_dump", "--data-only", fresh_postgres], capture_output=True,
                          text=True, check=True).stdout
    logs = b"".join(p.read_bytes() for p in tmp_path.glob("proxy-*.log"))
    assert b"listening on" in logs
    for blob in (journal, stored.encode(), dump.encode(), logs):
        assert SECRET.encode() not in blob and b"sk-client-own" not in blob
