"""The agent is untrusted: from inside an episode it can call the model and read the
models list, and nothing else reaches the engine, the admin API or the rewards.

Every attack runs against a logging upstream that records each request it receives;
the assertions are that it saw none of them, that the agent got a clear error in its
API's shape, and that the proxy counted the attempt.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import aiohttp
import openai
import pytest
from helpers.hostile import MESSAGES, SECRET, raw_request, refused_count
from helpers.http import admin_call
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.migrations import upgrade
from tracetap.proxy.admin import token as admin_token
from tracetap.proxy.admin.token import ensure_admin_token, read_admin_token
from tracetap.proxy.runtime.settings import Settings

# Real control endpoints that RL setups enable for weight sync.
SGLANG_CONTROLS = ["/update_weights_from_disk", "/update_weights_from_tensor", "/flush_cache",
                   "/pause_generation", "/continue_generation", "/release_memory_occupation",
                   "/init_weights_update_group", "/load_lora_adapter", "/abort_request"]
VLLM_CONTROLS = ["/sleep", "/wake_up", "/collective_rpc", "/reset_prefix_cache",
                 "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/server_info",
                 "/start_profile", "/scale_elastic_ep"]
TRAVERSALS = [
    "/episodes/e1/v1/../../flush_cache",
    "/episodes/e1/v1/%2e%2e/%2e%2e/flush_cache",
    "/episodes/e1/v1/%2E%2E/%2E%2E/sleep",
    "/v1/../sleep",
    "/v1/./../collective_rpc",
    "/v1/%2e%2e/update_weights_from_disk",
    "/v1/chat/completions/..%2f..%2fflush_cache",
    "//flush_cache",
    "/v1//chat/completions",
    "/episodes/e1/v1/..\\..\\sleep",
]


@pytest.mark.parametrize("prefix", ["", "/v1", "/episodes/e1", "/episodes/e1/v1"])
def test_engine_control_endpoints_never_reach_the_engine(hostile, seen, prefix):
    controls = SGLANG_CONTROLS + VLLM_CONTROLS
    for path in controls:
        status, body = raw_request(hostile, "POST", prefix + path,
                                   {"Content-Type": "application/json"}, b'{"model_path": "/evil"}')
        assert status == 404, (path, body)
        assert body["error"]["code"] == "not_exposed"
        assert "not exposed" in body["error"]["message"]
    assert seen == []
    assert refused_count(hostile, "not_exposed") == len(controls)


def test_traversal_and_encoding_variants_are_refused_before_routing(hostile, seen):
    for path in TRAVERSALS:
        status, body = raw_request(hostile, "POST", path,
                                   {"Content-Type": "application/json"}, b"{}")
        assert status in (400, 404), path
        assert body["error"]["code"] in ("invalid_path", "not_exposed"), (path, body)
    assert seen == []
    refusals = refused_count(hostile, "invalid_path") + refused_count(hostile, "not_exposed")
    assert refusals == len(TRAVERSALS)
    assert refused_count(hostile, "invalid_path") >= len(TRAVERSALS) - 1


def test_other_methods_on_model_paths_are_refused(hostile, seen):
    for method, path in [("PUT", "/v1/chat/completions"), ("DELETE", "/v1/models/m"),
                         ("OPTIONS", "/v1/chat/completions"), ("PATCH", "/v1/completions"),
                         ("GET", "/v1/chat/completions"), ("DELETE", "/episodes/e1/v1/models"),
                         ("POST", "/v1/models")]:
        status, body = raw_request(hostile, method, path)
        assert status == 404, (method, path)
        assert body.get("error", {}).get("code") == "not_exposed"
    assert seen == []


def test_refusals_speak_the_clients_api(hostile, seen):
    status, body = raw_request(hostile, "POST", "/episodes/e1/v1/sleep",
                               {"anthropic-version": "2023-06-01", "x-api-key": "k"})
    assert status == 404
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert seen == []


def test_the_model_api_still_works_is_captured_and_carries_the_upstream_key(hostile, seen):
    client = openai.OpenAI(base_url=hostile.episode_url("e1"), api_key="sk-agent",
                           max_retries=0)
    with client:
        reply = client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                               max_tokens=4)
        models = client.models.list()
    assert reply.choices[0].message.content
    assert [m.id for m in models.data] == ["mock-model"]
    # The operator's --allow-path rule: forwarded (the mock engine has no embeddings: 404).
    status, _ = raw_request(hostile, "POST", "/episodes/e1/v1/embeddings",
                            {"Content-Type": "application/json"}, b"{}")
    assert status == 404
    assert [(m, p) for m, p, _ in seen] == [("POST", "/v1/chat/completions"),
                                            ("GET", "/v1/models"), ("POST", "/v1/embeddings")]
    assert {auth for *_, auth in seen} == {f"Bearer {SECRET}"}
    # The captured call, and the uncaptured one that still shows in the episode.
    assert [(c["endpoint"], c["status"]) for c in hostile.calls("e1")] == [
        ("chat.completions", "ok"), ("/v1/embeddings", "passthrough")]
    # Base URL probes are answered by tracetap: the episode id never leaks upstream.
    for path in ("/episodes/e1", "/episodes/e1/v1", "/v1", "/"):
        assert raw_request(hostile, "HEAD", path)[0] == 200
        assert raw_request(hostile, "GET", path)[0] == 200
    assert len(seen) == 3


def test_an_agent_cannot_finish_or_grade_its_own_episode(hostile):
    status, created = hostile.admin("POST", "/tracetap/episodes", {"id": "graded"})
    assert status == 201
    key = created["api_key"]
    finish = "/tracetap/episodes/graded/finish"
    assert admin_call(hostile.url, "POST", finish, {"reward": 1.0})[0] == 401
    assert admin_call(hostile.url, "POST", finish, {"reward": 1.0}, token=key)[0] == 403
    assert admin_call(hostile.url, "POST", finish, {"reward": 1.0}, token="guess")[0] == 401
    # Through the agent's own base URL the admin API does not exist at all.
    status, body = raw_request(hostile, "POST", "/episodes/graded/v1/../../tracetap/episodes/graded"
                               "/finish", {"Authorization": f"Bearer {key}"}, b'{"reward": 1}')
    assert status == 400 and body["error"]["code"] == "invalid_path"
    assert hostile.episode("graded")["reward"] is None
    assert hostile.admin("POST", finish, {"reward": 0.25})[0] == 200
    assert hostile.episode("graded")["reward"] == 0.25


def test_a_minted_key_cannot_write_into_another_episode(hostile, seen):
    _, a = hostile.admin("POST", "/tracetap/episodes", {"id": "ep-a"})
    hostile.admin("POST", "/tracetap/episodes", {"id": "ep-b"})
    spoofs = [
        openai.OpenAI(base_url=hostile.episode_url("ep-b"), api_key=a["api_key"], max_retries=0),
        openai.OpenAI(base_url=hostile.url + "/v1", api_key=a["api_key"], max_retries=0,
                      default_headers={"X-Tracetap-Episode": "ep-b"}),
        openai.OpenAI(base_url=hostile.episode_url("ep-a"), api_key=a["api_key"], max_retries=0,
                      default_headers={"X-Tracetap-Episode": "ep-b"}),
    ]
    for client in spoofs:
        with client, pytest.raises(openai.PermissionDeniedError):
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert seen == []
    assert hostile.calls("ep-b") == []


def test_budgets_stop_a_runaway_agent(hostile, seen):
    status, created = hostile.admin("POST", "/tracetap/episodes", {
        "id": "runaway", "budget": {"max_calls": 2}})
    assert status == 201
    client = openai.OpenAI(base_url=created["base_url"], api_key=created["api_key"],
                           max_retries=0)
    with client:
        for _ in range(2):
            client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=2)
        for _ in range(3):
            with pytest.raises(openai.PermissionDeniedError) as refused:
                client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                               max_tokens=2)
    assert refused.value.code == "episode_budget_exceeded"
    assert "calls budget" in refused.value.message
    assert len(seen) == 2  # the refused calls never reached the engine
    hostile.flush()
    episode = hostile.episode("runaway")
    assert episode["budget_exceeded"] is True
    assert [c["status"] for c in episode["calls"]] == ["ok", "ok"] + ["budget_exceeded"] * 3
    text = hostile.state.metrics.render().decode()
    assert 'tracetap_episode_budget_exceeded_total{limit="calls"} 3.0' in text
    # A bad budget is refused at registration.
    assert hostile.admin("POST", "/tracetap/episodes", {"id": "x", "budget": {
        "max_calls": 0}})[0] == 400


def test_default_token_budget_from_the_settings(loop_thread, upstream, seen, tmp_path):
    db = f"sqlite:///{tmp_path / 'b.db'}"
    upgrade(db)
    settings = Settings(upstream=upstream, db=db, data_dir=str(tmp_path / "data"),
                        port=free_port(), episode_max_tokens=10)
    proxy = Proxy(loop_thread, settings).start()
    try:
        client = openai.OpenAI(base_url=proxy.episode_url("t"), api_key="x", max_retries=0)
        with client:
            first = client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                                   max_tokens=4)
            assert first.usage.total_tokens >= 10
            with pytest.raises(openai.PermissionDeniedError, match="tokens budget"):
                client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                               max_tokens=4)
        untagged = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        with untagged:  # budgets are per episode: calls outside any episode are not limited
            for _ in range(2):
                untagged.chat.completions.create(model="mock-model", messages=MESSAGES,
                                                 max_tokens=4)
        assert [p for m, p, _ in seen if m == "POST"] == ["/v1/chat/completions"] * 3
    finally:
        proxy.stop()


def test_serve_generates_an_owner_only_admin_token_and_the_cli_reads_it(
        upstream, run_proxy, tmp_path):
    db = f"sqlite:///{tmp_path / 's.db'}"
    data = tmp_path / "data"
    proxy = run_proxy(upstream, db, data_dir=data)
    token_file = data / "admin-token"
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
    assert str(token_file) in (tmp_path / "proxy-0.log").read_text()
    printed = subprocess.run([sys.executable, "-m", "tracetap", "admin-token",
                              "--data-dir", str(data)], capture_output=True, text=True,
                             check=True).stdout.strip()
    assert printed == token_file.read_text().strip() == proxy.admin_token
    assert admin_call(proxy.url, "GET", "/tracetap/episodes")[0] == 401
    assert proxy.admin("GET", "/tracetap/episodes")[0] == 200
    # A restart keeps the token: scripts that read it once keep working.
    proxy.stop()
    again = run_proxy(upstream, db, data_dir=data)
    assert again.admin_token == printed
    assert again.admin("GET", "/tracetap/episodes")[0] == 200


@pytest.mark.parametrize("content", ["", " \n\t \n"], ids=["empty", "whitespace"])
def test_an_empty_admin_token_file_never_opens_the_admin_api(upstream, tmp_path, content):
    """DATA_DIR/admin-token empty or whitespace only: ``serve`` refuses to start with a
    message naming the file (documented in proxy/admin/token.py); the file is left as it
    was. Kills ``read_admin_token`` returning the
    empty string (then ``ensure_admin_token`` hands ``""`` back, and a request without
    any token matches it: the admin API open to anyone), and ``ensure_admin_token``
    returning the empty token instead of raising."""
    data = tmp_path / "data"
    data.mkdir()
    token_file = data / "admin-token"
    token_file.write_text(content)
    assert read_admin_token(data) is None
    with pytest.raises(ValueError, match="admin-token exists but is empty"):
        ensure_admin_token(data)
    result = subprocess.run(  # a mutant that serves runs into the timeout: a failure too
        [sys.executable, "-m", "tracetap", "serve", "--upstream", upstream,
         "--db", f"sqlite:///{tmp_path / 'e.db'}", "--data-dir", str(data),
         "--port", str(free_port())],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"{token_file} exists but is empty: remove it or pass --admin-token" in result.stderr
    assert token_file.read_text() == content


def test_the_generated_admin_token_is_owner_only_and_shared_by_a_racing_start(
        tmp_path, monkeypatch):
    """In-process (mutation testing sees it): the token file is created with its folders,
    mode 0600 whatever the umask allows, and a start that loses the race to create it
    takes the winner's token. Kills the mode left out or changed, ``parents`` dropped from
    the mkdir, and the loser raising or making its own token."""
    data = tmp_path / "not" / "yet"
    token, path = ensure_admin_token(data)
    assert path == data / "admin-token" and path.read_text() == token + "\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(token) >= 43
    assert ensure_admin_token(data) == (token, path)  # kept across restarts

    other = tmp_path / "race"
    real_read = admin_token.read_admin_token

    def lose_the_race(data_dir):  # another process writes its token just after our look
        monkeypatch.setattr(admin_token, "read_admin_token", real_read)
        (other / "admin-token").write_text("the-winners-token\n")
        return None

    other.mkdir()
    monkeypatch.setattr(admin_token, "read_admin_token", lose_the_race)
    assert ensure_admin_token(other) == ("the-winners-token", other / "admin-token")


def test_admin_api_on_its_own_port_is_absent_from_the_agent_port(upstream, run_proxy,
                                                                 tmp_path):
    db = f"sqlite:///{tmp_path / 'p.db'}"
    admin_port = free_port()
    proxy = run_proxy(upstream, db, "--admin-port", str(admin_port), "--admin-token", "T0k")
    on_agent = admin_call(proxy.url, "POST", "/tracetap/episodes", {"id": "a"}, token="T0k")
    assert on_agent[0] == 404
    admin_url = f"http://127.0.0.1:{admin_port}"
    status, created = admin_call(admin_url, "POST", "/tracetap/episodes", {"id": "a"},
                                 token="T0k")
    assert status == 201
    assert admin_call(admin_url, "GET", "/tracetap/episodes/a")[0] == 401
    client = openai.OpenAI(base_url=created["base_url"], api_key="x", max_retries=0)
    with client:
        assert client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                              max_tokens=2).choices


def test_admin_api_on_a_unix_socket(upstream, run_proxy, tmp_path, loop_thread):
    db = f"sqlite:///{tmp_path / 'u.db'}"
    sock = tmp_path / "admin.sock"
    proxy = run_proxy(upstream, db, "--admin-socket", str(sock))
    assert stat.S_IMODE(os.stat(sock).st_mode) & 0o077 == 0
    token = proxy.admin_token
    assert admin_call(proxy.url, "GET", "/tracetap/episodes", token=token)[0] == 404

    async def over_socket() -> tuple[int, dict]:
        connector = aiohttp.UnixConnector(path=str(sock))
        async with aiohttp.ClientSession(connector=connector) as session, session.post(
                "http://admin/tracetap/episodes", json={"id": "s"},
                headers={"Authorization": f"Bearer {token}"}) as reply:
            return reply.status, await reply.json()

    status, created = loop_thread.run(over_socket())
    assert status == 201 and created["id"] == "s"


@pytest.mark.parametrize("rule", ["/v1/../sleep", "FETCH /x", "/tracetap/episodes"])
def test_bad_allow_path_rules_are_refused_by_the_settings(upstream, tmp_path, rule):
    with pytest.raises(ValueError, match="--allow-path"):
        Settings(upstream=upstream, data_dir=str(tmp_path), allow_path=[rule])


def test_a_bad_allow_path_rule_fails_serve_at_start(upstream, tmp_path):
    # The settings' refusal above, as `serve` reports it (one process: each costs seconds).
    result = subprocess.run(
        [sys.executable, "-m", "tracetap", "serve", "--upstream", upstream,
         "--data-dir", str(tmp_path), "--allow-path", "relative/path"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--allow-path" in result.stderr


def test_a_generated_admin_token_never_reads_as_an_option(tmp_path, monkeypatch):
    """`tracetap run --admin-token TOKEN` (and every command taking it) would take a token
    starting with '-' for an option: the generator draws again (1 in 64 did)."""
    draws = iter(["-starts-with-a-dash", "plain-token"])
    monkeypatch.setattr(admin_token.secrets, "token_urlsafe", lambda n: next(draws))
    token, path = ensure_admin_token(tmp_path)
    assert token == "plain-token" == path.read_text().strip()
