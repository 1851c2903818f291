"""The untrusted agent reading its grade off the side: ``/metrics`` is open (any scraper,
and so any agent that reaches the port), so it carries no episode's reward or integrity
verdict; those are the admin's, on ``/tracetap/metrics``.
"""

from __future__ import annotations

import openai
from helpers.hostile import MESSAGES
from helpers.http import fetch
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.proxy.runtime.settings import Settings

GRADES = ("tracetap_episode_reward", "tracetap_episodes_integrity",
          "tracetap_episode_integrity_causes")


def _graded(page: bytes) -> list[str]:
    return [line for line in page.decode().splitlines() if line.startswith(GRADES)]


def test_an_agent_reads_no_reward_off_the_open_metrics(hostile):
    status, created = hostile.admin("POST", "/tracetap/episodes", {"id": "graded"})
    assert status == 201
    key = created["api_key"]
    with openai.OpenAI(base_url=created["base_url"], api_key=key, max_retries=0) as agent:
        agent.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=2)
    assert hostile.admin("POST", "/tracetap/episodes/graded/finish",
                         {"reward": 0.37})[0] == 200
    for token in (None, key):  # as any scraper, and with the agent's own key
        status, page = fetch("GET", hostile.url + "/metrics", token=token)
        assert status == 200 and b"tracetap_episodes_finished_total 1.0" in page
        assert _graded(page) == []
    # The admin's page has them: the reward just given, the verdict.
    assert fetch("GET", hostile.url + "/tracetap/metrics")[0] == 401
    assert fetch("GET", hostile.url + "/tracetap/metrics", token=key)[0] == 403
    status, page = fetch("GET", hostile.url + "/tracetap/metrics", token=hostile.admin_token)
    assert status == 200
    assert "tracetap_episode_reward_sum 0.37" in _graded(page)
    assert 'tracetap_episodes_integrity_total{integrity="clean"} 1.0' in _graded(page)


def test_the_admin_metrics_are_not_served_on_the_agent_port(
        loop_thread, upstream, tmp_path, migrated_sqlite):
    admin_port = free_port()
    settings = Settings(upstream=upstream, db=migrated_sqlite(tmp_path / "a.db"),
                        data_dir=str(tmp_path / "data"), port=free_port(),
                        upstream_flavor="vllm", admin_port=admin_port)
    proxy = Proxy(loop_thread, settings).start()
    try:
        token = proxy.admin_token
        assert fetch("GET", proxy.url + "/tracetap/metrics", token=token)[0] == 404
        status, page = fetch("GET", proxy.url + "/metrics")
        assert status == 200 and _graded(page) == []
    finally:
        proxy.stop()
