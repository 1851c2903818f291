"""The policy under training against its own training signal: what it can do to its own
episode with only the episode's base URL (its key), each attack against the logging
upstream (tests/helpers/hostile.py) and the real openai SDK.

- Its own failures (a bad request, a stream it closes early, a budget it spends) keep its
  episode clean, with an ``agent_*`` cause per call; the operator's pause that outlasts
  its timeout is infra (storage.integrity, docs/export.md).
- Budgets charge the tokens that went out when a cut stream never reported usage.
- A finished episode's key takes no more calls; an id with calls is never registered;
  ``tracetap run``'s ids cannot be guessed.
- Only the operator chooses an episode's overlay (registration), never its agent.
- An episode's calls use its policy models only (refused, or stored apart and never
  stamped with the policy's version), the name checked after --model-map.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import msgspec
import openai
import pyarrow.parquet as pq
import pytest
from helpers.hostile import MESSAGES, refused_count
from helpers.http import finish, register
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.analysis.runner import plan
from tracetap.exporters import export
from tracetap.proxy.runtime.settings import Settings
from tracetap.storage import budget_ledger
from tracetap.storage.engine import create_engine
from tracetap.storage.integrity import verdicts_of


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def _stored(proxy, episode: str, count: int) -> list[dict]:
    """The episode's calls once ``count`` of them are stored (a cut stream is recorded
    when the proxy notices the client gone, at its next write)."""
    deadline = time.monotonic() + 30
    while len(calls := proxy.calls(episode)) < count:
        assert time.monotonic() < deadline, calls
        time.sleep(0.05)  # polling: the proxy records the cut call on its own time
    return calls


def _read(proxy, coro):
    async def go():
        engine = create_engine(proxy.settings.db)
        try:
            return await coro(engine)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def _verdict(proxy, episode: str):
    proxy.flush()
    return _read(proxy, lambda engine: verdicts_of(engine, [episode]))[episode]


# ---- budgets charge what the engine generated ----------------------------------------------

def test_cut_streams_are_charged_the_tokens_that_went_out(hostile, seen):
    """Six streams cut before their final usage chunk, in a 400-token budget: each is
    charged its prompt and the completion tokens it received, so the budget is spent
    and the calls after it are refused (403), never sent upstream."""
    created = register(hostile, "cutter", budget={"max_tokens": 400})
    outcomes = []
    with _client(created["base_url"]) as client:
        for n in range(6):
            try:
                stream = client.chat.completions.create(
                    model="mock-model", messages=MESSAGES, max_tokens=300, stream=True,
                    extra_body={"mock_completion_tokens": 300, "mock_chunk_delay_s": 0.002})
            except openai.PermissionDeniedError as refused:
                assert refused.code == "episode_budget_exceeded"
                outcomes.append("refused")
                continue
            got = 0
            for chunk in stream:
                got += sum(len(c.delta.content or "") > 0 for c in chunk.choices)
                if got >= 100:
                    break
            stream.close()  # cut before the final chunk: no usage reached the proxy
            outcomes.append("cut")
            _stored(hostile, "cutter", n + 1)
    spent = _read(hostile, lambda engine: budget_ledger.spent(engine, "cutter"))
    # Each cut stream received at least 100 tokens: no more than four fit in 400.
    admitted = outcomes.count("cut")
    assert 1 <= admitted <= 4, outcomes
    assert outcomes == ["cut"] * admitted + ["refused"] * (6 - admitted), outcomes
    assert spent.tokens_used >= 400 and spent.tokens_reserved == 0
    cut = [c for c in hostile.calls("cutter") if c["status"] == "client_disconnected"]
    # Charged at least the completion tokens each cut stream received.
    assert spent.tokens_used >= sum(len(c["choices"][0]["completion_ids"]) for c in cut)
    assert sum(1 for m, _, _ in seen if m == "POST") == outcomes.count("cut")
    # Its own cuts and its spent budget are the agent's: the episode stays trainable.
    finish(hostile, "cutter", 0.0)
    verdict = _verdict(hostile, "cutter")
    assert verdict.integrity == "clean"
    assert set(verdict.causes) == {"agent_disconnect", "agent_budget"}


# ---- the verdict says who failed -----------------------------------------------------------

def test_the_agents_own_failures_keep_its_episode_clean(hostile, seen):
    """A body that is not JSON, a request the engine refuses (4xx) and a stream closed
    early are the policy's doing: counted per call as agent_* causes, never infra (a
    trainer dropping infra episodes would otherwise drop exactly the ones it failed)."""
    created = register(hostile, "sly")
    with _client(created["base_url"]) as client:
        with pytest.raises(openai.BadRequestError):
            client.post("/chat/completions", cast_to=object, content=b"{not json",
                        options={"headers": {"Content-Type": "application/json"}})
        with pytest.raises(openai.BadRequestError):  # the engine's own 4xx
            client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                           max_tokens=2, extra_body={"mock_status": 400})
        stream = client.chat.completions.create(
            model="mock-model", messages=MESSAGES, max_tokens=200, stream=True,
            extra_body={"mock_completion_tokens": 200, "mock_chunk_delay_s": 0.005})
        next(iter(stream))
        stream.close()
    calls = _stored(hostile, "sly", 3)
    assert sorted((c["status"], c["http_status"]) for c in calls) == [
        ("bad_request", 400), ("client_disconnected", 200), ("ok", 400)]
    finish(hostile, "sly", 0.0)
    verdict = _verdict(hostile, "sly")
    assert verdict.integrity == "clean"
    assert verdict.causes == {"agent_bad_request": 2, "agent_disconnect": 1}


@pytest.fixture
def impatient(loop_thread, upstream, tmp_path, migrated_sqlite):
    """The logging upstream's proxy, whose pause holds a call at most 0.3 s."""
    settings = Settings(upstream=upstream, db=migrated_sqlite(tmp_path / "i.db"),
                        data_dir=str(tmp_path / "data"), port=free_port(),
                        upstream_flavor="vllm", pause_timeout=0.3)
    proxy = Proxy(loop_thread, settings).start()
    yield proxy
    proxy.stop()


def test_a_call_held_past_the_pause_timeout_is_the_operators(impatient, seen):
    proxy = impatient
    created = register(proxy, "held")
    assert proxy.admin("POST", "/tracetap/pause", {"wait": False})[0] == 200
    try:
        with _client(created["base_url"]) as client, pytest.raises(
                openai.APIStatusError) as held:
            client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                           max_tokens=2)
    finally:
        assert proxy.admin("POST", "/tracetap/resume", {})[0] == 200
    assert held.value.status_code == 503
    assert [c["status"] for c in _stored(proxy, "held", 1)] == ["paused"]
    verdict = _verdict(proxy, "held")
    assert (verdict.integrity, verdict.causes) == ("infra", {"paused": 1})
    assert not [m for m, _, _ in seen if m == "POST"]


# ---- keys live as long as their episode ----------------------------------------------------

def _ask(base_url: str, **options):
    with _client(base_url) as client:
        return client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                              max_tokens=2, **options)


def _other(proxy, tmp_path) -> Proxy:
    """A second proxy on the same database (another worker or replica)."""
    return Proxy(proxy.loop, msgspec.structs.replace(
        proxy.settings, port=free_port(), data_dir=str(tmp_path / "other"))).start()


def test_a_finished_episodes_key_takes_no_more_calls(hostile, seen, tmp_path):
    """After the grader's finish, the episode's base URL and its API key get 409 in the
    client's shape, counted, never sent upstream, nothing stored under it; so too on
    another proxy on the same database that had the key cached before the finish."""
    created = register(hostile, "graded")
    other = _other(hostile, tmp_path)
    try:
        other_url = created["base_url"].replace(hostile.url, other.url)
        assert _ask(created["base_url"]).choices and _ask(other_url).choices
        finish(hostile, "graded", 0.0)
        time.sleep(1.5)  # FOLLOW_SECONDS for the other proxy to learn of the finish
        for base_url, api_key in ((created["base_url"], "unused"),
                                  (hostile.url + "/v1", created["api_key"]),
                                  (other_url, "unused")):
            with openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client, \
                    pytest.raises(openai.ConflictError) as refused:
                client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                               max_tokens=2, stream=True)
            assert refused.value.code == "episode_finished"
            assert refused.value.body["type"] == "invalid_request_error"
        assert refused_count(hostile, "episode_finished") == 2
        assert refused_count(other, "episode_finished") == 1
    finally:
        other.stop()
    assert sum(1 for m, _, _ in seen if m == "POST") == 2
    assert len(hostile.calls("graded")) == 2
    # Graded once: the export holds the two calls made before the finish, no more.
    export(hostile.settings.db, tmp_path / "out", datasets=["calls"])
    rows = pq.read_table(tmp_path / "out" / "calls").to_pylist()
    assert sorted(r["episode_id"] for r in rows) == ["graded", "graded"]


def test_calls_to_an_id_before_its_registration_are_never_adopted(hostile, tmp_path):
    """An agent that guesses the next episode's id and calls it first: the registration
    of that id is refused (409), so nothing it sent is exported under the episode."""
    _ask(f"{hostile.url}/episodes/next-task.r0/v1")  # an open id: taken as untracked
    status, body = hostile.admin("POST", "/tracetap/episodes", {"id": "next-task.r0"})
    assert (status, body["error"]["code"]) == (409, "episode_has_calls")
    hostile.flush()
    # Another proxy on the database, which never served the call, finds it stored.
    other = _other(hostile, tmp_path)
    try:
        status, body = other.admin("POST", "/tracetap/episodes", {"id": "next-task.r0"})
    finally:
        other.stop()
    assert (status, body["error"]["code"]) == (409, "episode_has_calls")
    assert hostile.episode("next-task.r0")["registered"] is False


def test_run_episode_ids_cannot_be_guessed_without_the_runners_secret():
    task = plan.Task("django-1234", {})
    [slot] = plan.slots("nightly", [task], [{"a": 1}], 1, "{run_id}.{task_id}")
    guessed = slot.episode_id(0)  # what the inputs alone give
    real = slot.episode_id(0, "admin-token-A")
    assert real != guessed and real == slot.episode_id(0, "admin-token-A")  # reruns find it
    assert real != slot.episode_id(0, "admin-token-B")
    run, tag, rest = real.split(".", 2)
    assert (run, len(tag), f"{run}.{rest}") == ("nightly", 16, guessed)
    assert re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", real)


# ---- the operator decides overlays ---------------------------------------------------------

@pytest.fixture
def overlaid(loop_thread, upstream, tmp_path, migrated_sqlite):
    """The logging upstream's proxy with one overlay loaded (``noter``: a system note)."""
    settings = Settings(upstream=upstream, db=migrated_sqlite(tmp_path / "o.db"),
                        data_dir=str(tmp_path / "data"), port=free_port(),
                        upstream_flavor="vllm", overlay=["noter=tests.overlay_fixtures:noter"])
    proxy = Proxy(loop_thread, settings).start()
    yield proxy
    proxy.stop()


def test_the_agent_cannot_choose_an_overlay(overlaid, seen):
    """X-Tracetap-Overlay is refused (400, counted) on a registered episode and an open
    one, naming a loaded overlay or not, and the refusal names nothing loaded; the
    operator's registration is what runs, recorded per call and in the metadata."""
    proxy = overlaid
    plain = register(proxy, "plain")["base_url"]
    chosen = register(proxy, "chosen", overlay="noter")["base_url"]
    for base_url in (plain, f"{proxy.url}/episodes/open/v1", chosen):
        for name in ("noter", "other"):
            with pytest.raises(openai.BadRequestError) as refused:
                _ask(base_url, extra_headers={"X-Tracetap-Overlay": name})
            assert refused.value.code == "overlay_header"
            assert "noter" not in str(refused.value.body)
    assert refused_count(proxy, "overlay_header") == 6
    assert seen == []
    _ask(plain)
    _ask(chosen)
    [baseline] = [c for c in proxy.calls("plain") if c["status"] == "ok"]
    [treated] = [c for c in proxy.calls("chosen") if c["status"] == "ok"]
    assert baseline["overlay"] is None
    assert json.loads(treated["overlay"])["name"] == "noter"
    assert proxy.episode("plain")["metadata"] is None
    assert proxy.episode("chosen")["metadata"] == {"overlay": "noter"}
    status, body = proxy.admin("POST", "/tracetap/episodes", {"overlay": "nope"})
    assert status == 400 and "noter" not in body["error"]["message"]


# ---- an episode is bound to its policy models ----------------------------------------------

def _posts(seen) -> list[str]:
    return [path for method, path, _ in seen if method == "POST"]


def test_another_served_model_is_refused(hostile, seen):
    """An episode registered with policy_models cannot call the judge the upstream also
    serves: 403 in the client's shape, never sent upstream; its own model works."""
    bound = register(hostile, "bound", policy_models=["mock-model"])["base_url"]
    with _client(bound) as client:
        with pytest.raises(openai.PermissionDeniedError) as refused:
            client.chat.completions.create(model="judge-model", messages=MESSAGES,
                                           max_tokens=2)
        assert refused.value.code == "model_not_allowed"
        assert "mock-model" not in str(refused.value.body)  # its models are not listed
        assert client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                              max_tokens=2).choices
    assert len(_posts(seen)) == 1
    status, body = hostile.admin("POST", "/tracetap/episodes",
                                 {"metadata": {"policy_models": ["judge-model"]}})
    assert (status, body["error"]["code"]) == (400, "policy_models_in_metadata")


@pytest.fixture
def bound(loop_thread, upstream, tmp_path, migrated_sqlite, request):
    """The logging upstream's proxy serving only ``mock-model`` as the policy
    (``--policy-model``), Claude names mapped to the judge and GPT names to the policy."""
    settings = Settings(upstream=upstream, db=migrated_sqlite(tmp_path / "b.db"),
                        data_dir=str(tmp_path / "data"), port=free_port(),
                        upstream_flavor="vllm", policy_model=["mock-model"],
                        model_map=["claude-*=judge-model", "gpt-*=mock-model"],
                        other_models=request.param)
    proxy = Proxy(loop_thread, settings).start()
    yield proxy
    proxy.stop()


@pytest.mark.parametrize("bound", ["refuse"], indirect=True)
def test_the_mapped_model_name_is_the_one_checked(bound, seen):
    with _client(bound.episode_url("mapped")) as client:
        with pytest.raises(openai.PermissionDeniedError) as refused:  # claude-x → the judge
            client.chat.completions.create(model="claude-x", messages=MESSAGES, max_tokens=2)
        assert refused.value.code == "model_not_allowed"
        assert client.chat.completions.create(model="gpt-4o", messages=MESSAGES,
                                              max_tokens=2).choices  # → the policy
    assert len(_posts(seen)) == 1
    assert [(c["status"], c["http_status"]) for c in bound.calls("mapped")] == [
        ("bad_request", 403), ("ok", 200)]


@pytest.mark.parametrize("bound", ["store"], indirect=True)
def test_another_model_stored_apart_is_never_trained_nor_stamped(bound, tmp_path):
    """Under --other-models store the judge's reply is served, stored as other_model with
    no policy version, and left out of the episode's trajectories."""
    assert bound.admin("PUT", "/tracetap/policy", {"version": "v7"})[0] == 200
    with _client(bound.episode_url("side")) as client:
        for model in ("mock-model", "claude-judge"):
            assert client.chat.completions.create(model=model, messages=MESSAGES,
                                                  max_tokens=4).choices
    finish(bound, "side", 1.0)
    bound.flush()
    export(bound.settings.db, tmp_path / "out")
    calls = pq.read_table(tmp_path / "out" / "calls").to_pylist()
    assert sorted((c["status"], c["model"], c["policy_version"], c["integrity"])
                  for c in calls) == [("ok", "mock-model", "v7", "clean"),
                                      ("other_model", "judge-model", None, "clean")]
    [row] = pq.read_table(tmp_path / "out" / "trajectories").to_pylist()
    [policy] = [c for c in calls if c["status"] == "ok"]
    assert row["call_ids"] == [policy["call_id"]] and row["policy_versions"] == ["v7"]
