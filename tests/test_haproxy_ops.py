"""The shipped HAProxy config (deploy/haproxy/) as an operator runs it, with faults: the
admin API stays up through HAProxy while the engine is down, HAProxy's own errors are the
API's JSON, and its log never holds an episode's capability secret or key.

Real processes: Debian's haproxy with the shipped file (only the server lines local),
`tracetap serve` replicas on one Postgres, the mock engine, the real openai and anthropic
SDKs.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import anthropic
import openai
import pytest
from helpers.http import admin_call

from tracetap.migrations import upgrade

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from haproxy_lb import ADMIN_BACKEND, BACKEND, HAProxy

pytestmark = pytest.mark.skipif(
    shutil.which("haproxy") is None and not Path("/usr/sbin/haproxy").exists()
    and not os.environ.get("CI"), reason="haproxy not installed (apt-get install haproxy)")

TOKEN = "o" * 40
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture
def cluster(engine, fresh_postgres, run_proxy, tmp_path):
    """Two replicas on one migrated Postgres behind the shipped config, both up."""
    upgrade(fresh_postgres)
    replicas = [run_proxy(engine.url, fresh_postgres, "--admin-token", TOKEN,
                          data_dir=tmp_path / f"r{i}") for i in (1, 2)]
    lb = HAProxy(tmp_path, {f"r{i}": f"127.0.0.1:{p.port}"
                            for i, p in enumerate(replicas, start=1)})
    lb.start()
    lb.wait_until(lambda: len(lb.up(BACKEND)) == len(lb.up(ADMIN_BACKEND)) == 2)
    yield replicas, lb
    lb.stop()


def _raw_model_call(url: str) -> tuple[int, str, bytes]:
    request = urllib.request.Request(
        url + "/v1/chat/completions", method="POST",
        data=json.dumps({"model": "mock-model", "messages": MESSAGES}).encode(),
        headers={"Content-Type": "application/json", "X-Tracetap-Episode": "raw"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.headers["Content-Type"], error.read()


def test_engine_down_keeps_the_admin_api_up_and_model_calls_get_json(
        cluster, engine, loop_thread):
    _, lb = cluster
    loop_thread.run(engine.close())  # the model server goes away (a weight sync, a crash)
    lb.wait_until(lambda: lb.up(BACKEND) == [])
    # Out of the model backend only: the admin backend keeps both replicas.
    assert lb.up(ADMIN_BACKEND) == ["r1", "r2"]

    status, made = admin_call(lb.url, "POST", "/tracetap/episodes", {"id": "offline"}, TOKEN)
    assert status == 201, made
    status, paused = admin_call(lb.url, "POST", "/tracetap/pause", {"timeout": 10}, TOKEN)
    assert status == 200 and paused["drained"] is True, paused
    status, resumed = admin_call(lb.url, "POST", "/tracetap/resume",
                                 {"policy_version": "v2"}, TOKEN)
    assert (status, resumed["policy_version"]) == (200, "v2")
    status, finished = admin_call(lb.url, "POST", "/tracetap/episodes/offline/finish",
                                  {"reward": 1.0}, TOKEN)
    assert status == 200, finished

    # A model call gets HAProxy's 503 as JSON in the API's error shape, not an HTML page.
    status, content_type, body = _raw_model_call(lb.url)
    assert (status, content_type) == (503, "application/json")
    error = json.loads(body)["error"]
    assert error["code"] == "service_unavailable" and "retry" in error["message"]
    # And both SDK families read it as an API error with its message.
    agent_url = lb.url + urlsplit(made["base_url"]).path
    with openai.OpenAI(base_url=agent_url, api_key="x", max_retries=0) as client, \
            pytest.raises(openai.InternalServerError) as raised:
        client.chat.completions.create(model="mock-model", messages=MESSAGES)
    assert raised.value.status_code == 503
    assert raised.value.body["code"] == "service_unavailable"
    with anthropic.Anthropic(base_url=lb.url, api_key="x", max_retries=0) as client, \
            pytest.raises(anthropic.InternalServerError) as raised:
        client.messages.create(model="mock-model", max_tokens=4, messages=MESSAGES)
    assert raised.value.status_code == 503
    assert raised.value.body["error"]["type"] == "overloaded_error"


def test_haproxy_logs_the_path_without_the_episode_secret_or_key(cluster):
    _, lb = cluster
    status, made = admin_call(lb.url, "POST", "/tracetap/episodes", {"id": "logged"}, TOKEN)
    assert status == 201, made
    path = urlsplit(made["base_url"]).path  # /episodes/logged~<secret>/v1
    secret = path.split("/")[2].partition("~")[2]
    assert len(secret) > 20
    by_url = openai.OpenAI(base_url=lb.url + path, api_key="x", max_retries=0)
    by_key = openai.OpenAI(base_url=lb.url + "/v1", api_key=made["api_key"], max_retries=0)
    for client in (by_url, by_key):
        with client:
            client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=2)
    deadline = time.monotonic() + 10
    while (log := lb.log.read_text()).count("/chat/completions") < 2:
        assert time.monotonic() < deadline, log
        time.sleep(0.1)  # HAProxy writes a request's line when it ends
    assert secret not in log and made["api_key"] not in log and TOKEN not in log
    # The lines are there, with the path an operator needs, the secret cut out.
    assert '"POST /episodes/logged~.../v1/chat/completions HTTP/1.1"' in log
    assert '"POST /v1/chat/completions HTTP/1.1"' in log
