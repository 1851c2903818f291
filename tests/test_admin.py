"""Admin API round trips and the three ways of tagging a call."""

from __future__ import annotations

import msgspec
import openai
import pytest
from helpers.loop import free_port
from helpers.servers import Proxy

MESSAGES = [{"role": "user", "content": "hello"}]


def test_create_call_with_key_finish_and_read_back(proxy):
    status, created = proxy.admin("POST", "/tracetap/episodes", {
        "id": "ep-key", "group_id": "g1", "task_id": "t1",
        "harness": {"name": "scripted", "config": {"temperature": 1.0}},
        "metadata": {"seed": 3}})
    assert status == 201
    assert created["id"] == "ep-key" and created["api_key"].startswith("tt-")
    assert created["base_url"] == proxy.episode_url("ep-key")

    # A harness that can only set the key: plain /v1 base URL plus the minted key.
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=created["api_key"])
    with client:
        client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=4)
    proxy.flush()

    status, _ = proxy.admin("POST", "/tracetap/episodes/ep-key/finish", {
        "reward": 0.5, "rewards": {"tests": 1.0}, "outcome": "solved", "info": {"steps": 1}})
    assert status == 200
    status, episode = proxy.admin("GET", "/tracetap/episodes/ep-key")
    assert status == 200
    assert episode["group_id"] == "g1" and episode["task_id"] == "t1"
    assert episode["harness"] == {"name": "scripted", "config": {"temperature": 1.0}}
    assert episode["metadata"] == {"seed": 3}
    assert episode["reward"] == 0.5 and episode["rewards"] == {"tests": 1.0}
    assert episode["outcome"] == "solved" and episode["info"] == {"steps": 1}
    assert episode["finished_at"] is not None
    assert [c["seq"] for c in episode["calls"]] == [0]
    assert episode["calls"][0]["status"] == "ok"


def test_creating_an_existing_episode_is_a_409(proxy):
    assert proxy.admin("POST", "/tracetap/episodes", {"id": "dup"})[0] == 201
    status, error = proxy.admin("POST", "/tracetap/episodes", {"id": "dup"})
    assert status == 409 and error["error"]["code"] == "episode_exists"


def test_created_id_defaults_to_a_fresh_one(proxy):
    _, first = proxy.admin("POST", "/tracetap/episodes", {})
    _, second = proxy.admin("POST", "/tracetap/episodes", {})
    assert first["id"] != second["id"]


@pytest.mark.parametrize("body", [{"id": "bad id"}, {"unknown": 1}, {"group_id": 5}])
def test_invalid_admin_input_is_a_400(proxy, body):
    status, error = proxy.admin("POST", "/tracetap/episodes", body)
    assert status == 400 and error["error"]["message"]


def test_list_is_paged(proxy):
    for i in range(5):
        proxy.admin("POST", "/tracetap/episodes", {"id": f"page-{i}", "group_id": "pg"})
    _, page = proxy.admin("GET", "/tracetap/episodes?group_id=pg&limit=2&offset=2")
    assert page["total"] == 5
    assert [e["id"] for e in page["data"]] == ["page-2", "page-3"]


def test_tagging_by_header_and_precedence_of_path(proxy):
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x",
                           default_headers={"X-Tracetap-Episode": "by-header"})
    with client:
        client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=4)
    path_client = openai.OpenAI(base_url=proxy.episode_url("by-path"), api_key="x",
                                default_headers={"X-Tracetap-Episode": "by-header"})
    with path_client:
        path_client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=4)
    assert len(proxy.calls("by-header")) == 1
    assert len(proxy.calls("by-path")) == 1


def test_policy_version_stamps_later_calls(proxy):
    client = openai.OpenAI(base_url=proxy.episode_url("policy"), api_key="x")
    with client:
        client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=4)
        assert proxy.admin("PUT", "/tracetap/policy", {"version": "step-10"})[0] == 200
        client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=4)
    assert [c["policy_version"] for c in proxy.calls("policy")] == [None, "step-10"]


def test_pause_and_policy_version_survive_a_restart_and_reach_a_second_process(
        loop_thread, proxy_settings):
    first = Proxy(loop_thread, proxy_settings).start()
    second = Proxy(loop_thread, msgspec.structs.replace(proxy_settings, port=free_port()))
    second.start()  # another process on the same database, as a worker or replica is
    try:
        assert first.admin("PUT", "/tracetap/policy", {"version": "step-3"})[0] == 200
        status, paused = first.admin("POST", "/tracetap/pause", {"timeout": 20})
        # Drained means every process on the database holds the pause, none in a call.
        assert status == 200 and paused["drained"] is True
        assert second.state.gate.paused  # it reported holding this pause to get there
        assert second.state.controls.policy_version == "step-3"
    finally:
        first.stop()
        second.stop()
    restarted = Proxy(loop_thread, proxy_settings).start()
    try:
        assert restarted.admin("GET", "/tracetap/policy") == (200, {"version": "step-3"})
        assert restarted.admin("GET", "/readyz")[1]["paused"] is True
        assert restarted.admin("POST", "/tracetap/resume", {"policy_version": "step-4"}) == (
            200, {"paused": False, "policy_version": "step-4"})
        client = openai.OpenAI(base_url=restarted.episode_url("again"), api_key="x")
        with client:
            client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=4)
        assert [c["policy_version"] for c in restarted.calls("again")] == ["step-4"]
    finally:
        restarted.stop()


def test_healthz(proxy):
    assert proxy.admin("GET", "/healthz") == (200, {"status": "ok"})


def test_finishing_an_episode_nobody_has_seen_is_a_404(proxy):
    status, error = proxy.admin("POST", "/tracetap/episodes/ep-tpyo/finish", {"reward": 1.0})
    assert status == 404
    assert "'ep-tpyo'" in error["error"]["message"] and "never registered" in \
        error["error"]["message"]
    assert proxy.episode("ep-tpyo") is None  # nothing half written


def test_a_finish_racing_the_last_calls_commit_still_lands(proxy):
    client = openai.OpenAI(base_url=proxy.episode_url("ep-race"), api_key="x", max_retries=0)
    with client:
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    # No flush: the call may not be committed yet, but this proxy served it.
    assert proxy.admin("POST", "/tracetap/episodes/ep-race/finish", {"reward": 0.5})[0] == 200
    proxy.flush()
    episode = proxy.episode("ep-race")
    assert episode["reward"] == 0.5 and len(episode["calls"]) == 1
