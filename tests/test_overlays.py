"""Model-boundary overlays (docs/overlays.md): each hook's effect and record, exact
training data, failing overlays, and the harness's view, through the real SDKs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import anthropic
import openai
import pyarrow.parquet as pq
import pytest
from helpers.http import episode_headers, finish, metrics_text, register
from helpers.loop import free_port
from helpers.servers import Proxy

from tests.overlay_fixtures import NOTE
from tracetap.demo.agent import TASKS, TOOLS, run_agent
from tracetap.demo.engine import EngineConfig, EngineServer
from tracetap.exporters import export
from tracetap.migrations import upgrade
from tracetap.proxy.apis.registry import readers
from tracetap.proxy.overlays.loader import load_overlays
from tracetap.proxy.runtime.settings import Settings

BAD_ARGS = 0.4  # the engine's seeded fraction of tool calls with invalid arguments
OVERLAYS = [
    "noter=tests.overlay_fixtures:noter",
    "rewriter=tests.overlay_fixtures:rewriter",
    "vetoer=tests.overlay_fixtures:first_vetoer",
    "raiser=tests.overlay_fixtures:raiser",
    "sleeper=tests.overlay_fixtures:sleeper",
    "validator=tracetap.proxy.overlays.examples:tool_args_validator",
    "hint=tracetap.proxy.overlays.examples:recovery_hint,pattern=^Fact",
    "gated=tests.overlay_fixtures:gated_tool_vetoer",
    "toolrewriter=tests.overlay_fixtures:tool_rewriter",
    "toolraiser=tests.overlay_fixtures:tool_raiser",
    "longvetoer=tests.overlay_fixtures:long_vetoer",
    "vetothenraise=tests.overlay_fixtures:veto_then_raise",
]


@pytest.fixture
def db_url(request, tmp_path):
    """SQLite here (the hooks do not depend on the database); the training-data test also
    runs on Postgres (``pg_proxy``)."""
    url = f"sqlite:///{tmp_path / 'tracetap.db'}"
    upgrade(url)
    return url


@pytest.fixture
def pg_proxy(loop_thread, engine, fresh_postgres, tmp_path):
    upgrade(fresh_postgres)
    p = _proxy(loop_thread, engine, fresh_postgres, tmp_path)
    yield p
    p.stop()


@pytest.fixture
def engine_config() -> EngineConfig:
    return EngineConfig(flavor="vllm", bad_tool_args=BAD_ARGS)


def _proxy(loop_thread, engine, db_url, tmp_path, **options) -> Proxy:
    settings = Settings(upstream=engine.url, db=db_url, data_dir=str(tmp_path / "data"),
                        port=free_port(), overlay=OVERLAYS, **{"overlay_timeout": 0.2, **options})
    return Proxy(loop_thread, settings).start()


@pytest.fixture
def proxy(loop_thread, engine, db_url, tmp_path):
    p = _proxy(loop_thread, engine, db_url, tmp_path)
    yield p
    p.stop()


def agent(proxy, episode: str, task=TASKS[0], seed: int = 0, **client):
    async def go():
        async with openai.AsyncOpenAI(base_url=proxy.episode_url(episode), api_key="unused",
                                      max_retries=0, **client) as sdk:
            return await run_agent(sdk, task, model="mock-model", seed=seed)

    return proxy.loop.run(go())


def chat(proxy, episode: str, messages, *, stream: bool, tools=None, headers=None, **extra):
    """One chat call through the sync SDK; returns (content, tool calls) as received."""
    with openai.OpenAI(base_url=proxy.episode_url(episode), api_key="unused", max_retries=0,
                       default_headers=headers) as sdk:
        return _one_completion(sdk, messages, stream=stream, tools=tools, extra=extra)


def _one_completion(sdk, messages, *, stream: bool, tools, extra):
    kwargs = {"model": "mock-model", "messages": messages, "seed": 1, "extra_body": extra}
    if tools:
        kwargs["tools"] = tools
    if not stream:
        message = sdk.chat.completions.create(**kwargs).choices[0].message
        return message.content, [c.function.arguments for c in message.tool_calls or ()]
    content, arguments = "", {}
    for chunk in sdk.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                arguments[call.index] = arguments.get(call.index, "") + (
                    call.function.arguments or "")
    return content or None, [arguments[i] for i in sorted(arguments)]


def overlay_of(call: dict) -> dict:
    return json.loads(call["overlay"])


def events(calls: list[dict]) -> list[tuple[str, str]]:
    return [(e["hook"], e["action"]) for c in calls for e in overlay_of(c).get("events", [])]


def overlay_events(proxy) -> dict[tuple[str, str, str], float]:
    """tracetap_overlay_events_total by (overlay, hook, action)."""
    lines = metrics_text(proxy.url).splitlines()
    counts = {}
    for line in lines:
        if line.startswith("tracetap_overlay_events_total{"):
            labels = dict(pair.split("=", 1) for pair in line[30:].split("}")[0].split(","))
            key = tuple(labels[k].strip('"') for k in ("overlay", "hook", "action"))
            counts[key] = float(line.rsplit(" ", 1)[1])
    return counts


def trajectories(proxy, tmp_path, episode: str) -> list[dict]:
    status, _ = proxy.admin("POST", f"/tracetap/episodes/{episode}/finish", {"reward": 1.0})
    assert status == 200
    proxy.flush()
    export(proxy.settings.db, tmp_path / episode)
    rows = pq.read_table(tmp_path / episode / "trajectories").to_pylist()
    return [r for r in rows if r["episode_id"] == episode]


SYSTEM = {"role": "system", "content": "Answer."}
QUESTION = {"role": "user", "content": "What is it?"}


# ---- the batch: without the validator some episodes fail, with it they recover --------

def test_the_validator_overlay_recovers_episodes_that_fail_without_it(proxy):
    batch = [(task, seed) for task in TASKS for seed in range(3)]
    for t, s in batch:  # the same harness both times; only the overlay differs
        register(proxy, f"plain-{t.id}-{s}", task_id=t.id, harness={"name": "scripted"})
    plain = [agent(proxy, f"plain-{t.id}-{s}", t, s) for t, s in batch]
    for t, s in batch:
        register(proxy, f"patched-{t.id}-{s}", overlay="validator", task_id=t.id,
                 harness={"name": "scripted"})
    patched = [agent(proxy, f"patched-{t.id}-{s}", t, s) for t, s in batch]
    for name, runs in (("plain", plain), ("patched", patched)):
        for (t, s), run in zip(batch, runs):
            status, reply = proxy.admin(
                "POST", f"/tracetap/episodes/{name}-{t.id}-{s}/finish",
                {"reward": float(run.failure is None),
                 "outcome": "success" if run.failure is None else "failure"})
            assert status == 200, reply

    solved_plain = sum(run.failure is None for run in plain)
    solved_patched = sum(run.failure is None for run in patched)
    assert 0 < solved_plain < len(batch)  # the seeded failure mode bites
    assert solved_patched > solved_plain
    assert all("must be an integer" in run.failure for run in plain if run.failure)
    calls = {(t.id, s): proxy.calls(f"patched-{t.id}-{s}") for t, s in batch}
    for key, run in zip(calls, patched):
        # An episode still lost had every sample of one turn rejected (the re-sample
        # limit): the overlay delivered the last one, and said so.
        limited = ("after_model", "resample_limit") in events(calls[key])
        assert limited == (run.failure is not None), key
    # Every rejected sample is its own stored call, and the metric counts each.
    vetoed = [c for cs in calls.values() for c in cs if c["status"] == "vetoed"]
    assert vetoed and all(events([c]) == [("after_model", "veto")] for c in vetoed)
    assert overlay_events(proxy)["validator", "after_model", "veto"] == len(vetoed)
    # The episode's metadata names the overlay, for comparing runs by it.
    assert proxy.episode(f"patched-{batch[0][0].id}-0")["metadata"] == {"overlay": "validator"}
    # `tracetap compare` reads the positive Δ_B off the same database: tasks paired, each
    # task's three seeds averaged, so Δ_B is the difference in episodes solved per episode.
    compared = subprocess.run(
        [sys.executable, "-m", "tracetap", "compare", "--db", proxy.settings.database_url,
         "--baseline", "harness=scripted,overlay=null", "--candidate", "overlay=validator",
         "--json"], capture_output=True, text=True, timeout=120)
    assert compared.returncode == 0, compared.stderr
    (candidate,) = json.loads(compared.stdout)["candidates"]
    assert candidate["paired_tasks"] == len(TASKS)
    assert candidate["delta"] == pytest.approx((solved_patched - solved_plain) / len(batch))
    assert candidate["delta"] > 0 and candidate["flips"]["broken"] == []


# ---- each hook: its effect, and its record ---------------------------------------------

def test_before_model_adds_context_the_harness_never_sees_and_it_stays(proxy):
    register(proxy, "noted", overlay="noter", task_id="t1")
    first = chat(proxy, "noted", [SYSTEM, QUESTION], stream=False)
    later = [SYSTEM, QUESTION, {"role": "assistant", "content": first[0]},
             {"role": "user", "content": "And then?"}]
    chat(proxy, "noted", later, stream=True)
    calls = proxy.calls("noted")
    for call in calls:
        sent = json.loads(call["request"])["messages"]
        given = json.loads(call["upstream_request"])["messages"]
        assert NOTE not in json.dumps(sent)  # the harness's request, as it sent it
        assert given == [sent[0], {"role": "system", "content": NOTE}, *sent[1:]]
    assert events(calls) == [("before_model", "inject")]  # once; then kept in the context
    assert NOTE not in (first[0] or "")


def test_on_observation_sees_tool_results_and_adds_a_recovery_hint(proxy):
    register(proxy, "hinted", overlay="hint")
    run = agent(proxy, "hinted", TASKS[3], seed=7)
    assert run.failure is None or "must be an integer" in run.failure
    calls = proxy.calls("hinted")
    hinted = [c for c in calls if ("on_observation", "inject") in events([c])]
    assert hinted, events(calls)
    for call in hinted:
        given = json.loads(call["upstream_request"])["messages"]
        assert given[-1]["role"] == "user" and "reported an error" in given[-1]["content"]
        assert "reported an error" not in call["request"]


@pytest.mark.parametrize("stream", [False, True])
def test_after_model_rewrite_reaches_the_harness_and_the_models_reply_is_kept(proxy, stream):
    register(proxy, f"rewritten-{stream}", overlay="rewriter")
    content, _ = chat(proxy, f"rewritten-{stream}", [SYSTEM, QUESTION], stream=stream,
                      logprobs=True)
    assert content == "Rewritten by the overlay."
    (call,) = proxy.calls(f"rewritten-{stream}")
    model_text = call["choices"][0]["text"]
    assert model_text and model_text != content  # what the model sampled, kept
    assert json.loads(call["response"])["choices"][0]["message"]["content"] == model_text
    delivered = json.loads(overlay_of(call)["delivered"])
    assert delivered["choices"][0]["message"]["content"] == content
    assert events([call]) == [("after_model", "rewrite")]


@pytest.mark.parametrize("stream", [False, True])
def test_a_vetoed_reply_is_sampled_again_and_stored_as_its_own_call(proxy, stream):
    register(proxy, f"vetoed-{stream}", overlay="vetoer")
    assert proxy.admin("PUT", "/tracetap/policy", {"version": "step-7"})[0] == 200
    content, _ = chat(proxy, f"vetoed-{stream}", [SYSTEM, QUESTION], stream=stream)
    first, second = proxy.calls(f"vetoed-{stream}")
    assert (first["status"], second["status"]) == ("vetoed", "ok")
    # The re-sample is stamped with the harness's call's version, as that was admitted.
    assert (first["policy_version"], second["policy_version"]) == ("step-7", "step-7")
    assert "first attempt" in first["error"]
    assert overlay_of(second)["retry_of"] == first["call_id"]
    assert overlay_of(second)["attempt"] == 1
    assert content == second["choices"][0]["text"] != first["choices"][0]["text"]
    given = json.loads(second["upstream_request"])["messages"]
    assert given[-2] == {"role": "assistant", "content": first["choices"][0]["text"]}
    assert given[-1] == {"role": "user", "content": "Try once more."}
    assert json.loads(second["request"]) == json.loads(first["request"])


def test_on_episode_start_gets_the_registration_and_its_state_reaches_the_hooks(
        loop_thread, engine, db_url, tmp_path):
    tasks = tmp_path / "tasks.json"
    tasks.write_text(json.dumps({"t-7": "Never call a tool twice.", "*": "Be kind."}))
    p = _proxy(loop_thread, engine, db_url, tmp_path / "r")
    reminder = Settings(upstream=engine.url, db=db_url, port=free_port(),
                        data_dir=str(tmp_path / "r2"),
                        overlay=[f"remind=tracetap.proxy.overlays.examples:constraint_reminder,"
                                 f"path={tasks}"])
    r = Proxy(loop_thread, reminder).start()
    try:
        register(r, "reminded", overlay="remind", task_id="t-7")
        chat(r, "reminded", [SYSTEM, QUESTION], stream=False)
        (call,) = r.calls("reminded")
        given = json.loads(call["upstream_request"])["messages"]
        assert given[1] == {"role": "system", "content": "Constraints: Never call a tool twice."}
    finally:
        r.stop()
        p.stop()


# ---- exact training data ------------------------------------------------------------------

@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_trained_tokens_are_exactly_the_model_sampled_ones(request, tmp_path, database):
    """Vetoes, re-samples and injected context in one episode: every trainable token is a
    completion id the engine returned for a call the harness went on with; a vetoed
    sample is only ever trained in its own row; overlay-written tokens are context."""
    proxy = request.getfixturevalue("proxy" if database == "sqlite" else "pg_proxy")
    register(proxy, "exact", overlay="validator")
    run = agent(proxy, "exact", TASKS[0], seed=0)
    assert run.failure is None
    calls = {c["call_id"]: c for c in proxy.calls("exact")}
    vetoed = {i for i, c in calls.items() if c["status"] == "vetoed"}
    assert vetoed
    rows = trajectories(proxy, tmp_path, "exact")
    main = [r for r in rows if r["split_reason"] is None]
    assert len(main) == 1  # the overlay's additions stay in the context: one trajectory
    for row in rows:
        trained = [t for t, m in zip(row["response_ids"], row["response_mask"]) if m]
        sampled = [t for i in row["call_ids"] for t in calls[i]["choices"][0]["completion_ids"]]
        if row["split_reason"] == "vetoed":
            assert row["call_ids"][0] in vetoed and trained == sampled
            continue
        assert not vetoed & set(row["call_ids"])
        assert trained == sampled
    # The vetoed sample and the feedback sit in the main row as context only (mask 0).
    row = main[0]
    context = row["prompt_ids"] + [t for t, m in zip(row["response_ids"], row["response_mask"])
                                   if not m]
    feedback = b"Call the tool again with arguments that match its schema."
    assert bytes(t for t in context if t < 256).find(feedback) >= 0
    assert {r["call_ids"][0] for r in rows if r["split_reason"] == "vetoed"} == vetoed


# ---- failing overlays ---------------------------------------------------------------------

@pytest.mark.parametrize("overlay", ["raiser", "sleeper"])
def test_a_raising_or_slow_overlay_leaves_calls_intact_when_failing_open(proxy, overlay):
    reference = chat(proxy, "no-overlay", [SYSTEM, QUESTION], stream=False)
    register(proxy, f"broken-{overlay}", overlay=overlay)
    for stream in (False, True):
        assert chat(proxy, f"broken-{overlay}", [SYSTEM, QUESTION], stream=stream) == reference
    calls = proxy.calls(f"broken-{overlay}")
    assert [c["status"] for c in calls] == ["ok", "ok"]
    assert all(c["upstream_request"] is None for c in calls)  # the model got the request
    failure = "error" if overlay == "raiser" else "timeout"
    assert {a for _, a in events(calls)} == {failure}
    assert {h for h, _ in events(calls)} >= {"before_model", "after_model"}
    assert overlay_events(proxy)[overlay, "after_model", failure] == 2


@pytest.mark.parametrize("overlay", ["raiser", "sleeper"])
def test_a_failing_overlay_fails_the_call_clearly_when_closed(
        loop_thread, engine, db_url, tmp_path, overlay):
    p = _proxy(loop_thread, engine, db_url, tmp_path, overlay_fail="closed")
    try:
        register(p, "closed", overlay=overlay)
        with pytest.raises(openai.InternalServerError) as caught:
            chat(p, "closed", [SYSTEM, QUESTION], stream=True)
        assert caught.value.code == "overlay_failed"
        assert f"overlay '{overlay}' failed in" in caught.value.message
        (call,) = p.calls("closed")
        assert (call["status"], call["http_status"]) == ("overlay_failed", 500)
    finally:
        p.stop()


def test_a_veto_reason_is_kept_to_its_first_thousand_characters(proxy):
    register(proxy, "long-veto", overlay="longvetoer")
    chat(proxy, "long-veto", [SYSTEM, QUESTION], stream=False)
    first, _ = proxy.calls("long-veto")
    assert first["error"] == ("vetoed by overlay 'longvetoer': " + "why " * 500)[:1000]


def test_a_resample_whose_judgment_fails_closed_is_stored_as_failed(
        loop_thread, engine, db_url, tmp_path):
    """The re-sample is a record of its own, complete when its review fails: journaled
    with the failure and its status code, beside the vetoed first attempt."""
    p = _proxy(loop_thread, engine, db_url, tmp_path, overlay_fail="closed")
    try:
        register(p, "resample-closed", overlay="vetothenraise")
        with pytest.raises(openai.InternalServerError) as caught:
            chat(p, "resample-closed", [SYSTEM, QUESTION], stream=False)
        assert caught.value.code == "overlay_failed"
        first, second = p.calls("resample-closed")
        assert (first["status"], second["status"]) == ("vetoed", "overlay_failed")
        assert second["http_status"] == 500
        assert "overlay 'vetothenraise' failed in after_model" in second["error"]
    finally:
        p.stop()


# ---- an upstream that breaks while its reply is held ------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_breaking_in_a_held_reply_is_a_502_that_says_why(proxy, stream):
    """The held reply never reached the client: it gets a 502 naming the upstream's
    failure (``CallReview.hold``), and the call is recorded with it."""
    episode = f"held-broken-{stream}"
    register(proxy, episode, overlay="vetoer")
    with pytest.raises(openai.APIStatusError) as caught:
        chat(proxy, episode, [SYSTEM, QUESTION], stream=stream, mock_fail_after_chunks=2,
             mock_completion_tokens=20)
    assert caught.value.status_code == 502 and caught.value.code == "upstream_error"
    message = caught.value.body["message"]
    reason = message.removeprefix("upstream failed mid-reply: ")
    assert reason != message and "Payload" in reason, message  # aiohttp's error, named
    (call,) = proxy.calls(episode)
    assert (call["status"], call["http_status"]) == ("upstream_error", 502)
    assert call["error"] == message


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_error_under_review_reaches_the_client_as_it_came(proxy, stream):
    """A refusal is a whole JSON body even when a stream was asked for: held and given
    back as the upstream's error, not read as events."""
    episode = f"held-refused-{stream}"
    register(proxy, episode, overlay="vetoer")
    with pytest.raises(openai.BadRequestError) as caught:
        chat(proxy, episode, [SYSTEM, QUESTION], stream=stream, mock_status=400)
    assert caught.value.body["message"] == "Injected failure (mock_status=400)"
    (call,) = proxy.calls(episode)
    assert (call["status"], call["http_status"]) == ("ok", 400)  # the upstream's answer
    assert json.loads(call["response"])["error"] == caught.value.body


# ---- the harness's view ---------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_harness_gets_well_formed_replies_in_its_own_api(
        loop_thread, engine, db_url, tmp_path, stream):
    """Translated to chat upstream: rewritten and re-sampled replies in the Responses API."""
    proxy = _proxy(loop_thread, engine, db_url, tmp_path, translate="all")
    try:
        _responses_episodes(proxy, stream)
    finally:
        proxy.stop()


def _responses_episodes(proxy, stream: bool) -> None:
    register(proxy, f"responses-{stream}", overlay="rewriter")
    register(proxy, f"responses-veto-{stream}", overlay="vetoer")
    with openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0) as sdk:
        texts = _responses(sdk, stream, f"responses-{stream}", f"responses-veto-{stream}")
    assert texts[0] == "Rewritten by the overlay."
    accepted = [c for c in proxy.calls(f"responses-veto-{stream}") if c["status"] == "ok"]
    assert texts[1] == accepted[0]["choices"][0]["text"]


def _responses(sdk, stream: bool, *episodes: str) -> list[str]:
    texts = []
    for episode in episodes:
        kwargs = {"model": "mock-model", "input": "What is it?", "stream": stream,
                  "extra_headers": episode_headers(str(sdk.base_url).rstrip("/")[:-3],
                                                   episode)}
        if stream:
            with sdk.responses.stream(**{k: v for k, v in kwargs.items() if k != "stream"}) as s:
                texts.append(s.get_final_response().output_text)
        else:
            texts.append(sdk.responses.create(**kwargs).output_text)
    return texts


def test_tool_call_rewrites_reach_the_harness_as_tool_calls(proxy):
    register(proxy, "tool-rewrite", overlay="rewriter")
    for stream in (False, True):
        from tracetap.demo.agent import TOOLS

        _, arguments = chat(proxy, "tool-rewrite", [SYSTEM, QUESTION], stream=stream,
                            tools=TOOLS)
        assert arguments == ['{"step":1}']


# ---- tool calls only: the text before them streams live ------------------------------------

@pytest.fixture
def gated_proxy(loop_thread, engine, db_url, tmp_path):
    """Hooks may wait for the test's client (``gated``): a budget they never reach."""
    p = _proxy(loop_thread, engine, db_url, tmp_path, overlay_timeout=10)
    yield p
    p.stop()


def _live_chat(proxy, episode: str, gate, *, tools=TOOLS, **extra) -> tuple[str, list[dict]]:
    """One streamed chat call; the gate opens once the client holds text. Returns the
    content and the tool calls (id, name, arguments) as the client assembled them."""
    content, calls = "", {}
    with openai.OpenAI(base_url=proxy.episode_url(episode), api_key="unused",
                       max_retries=0) as sdk:
        for chunk in sdk.chat.completions.create(
                model="mock-model", messages=[SYSTEM, QUESTION], seed=1, stream=True,
                extra_body=extra, **({"tools": tools} if tools else {})):
            for choice in chunk.choices:
                if choice.delta.content:
                    content += choice.delta.content
                    gate.set()
                for delta in choice.delta.tool_calls or ():
                    call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                    call["id"] = delta.id or call["id"]
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)]


def _sampled(call: dict) -> dict:
    return json.loads(call["response"])["choices"][0]["message"]


def test_text_before_the_first_tool_call_streams_live_and_a_veto_sends_the_new_calls(
        gated_proxy, tmp_path):
    gated = gated_proxy.state.overlays.loaded["gated"]
    register(gated_proxy, "live", overlay="gated")
    content, tool_calls = _live_chat(gated_proxy, "live", gated.gate)
    # The hook judged only once the client had the text: it went out before the verdict.
    assert gated.opened == [True, True]
    first, second = gated_proxy.calls("live")
    assert (first["status"], second["status"]) == ("vetoed", "ok")
    vetoed, accepted = _sampled(first), _sampled(second)
    # The client's text is the first (vetoed) attempt's, as sampled; its tool calls are
    # the accepted re-sample's, ids included.
    assert content and content == vetoed["content"]
    assert tool_calls == [{"id": t["id"], **t["function"]} for t in accepted["tool_calls"]]
    assert tool_calls != [{"id": t["id"], **t["function"]} for t in vetoed["tool_calls"]]
    # The harness got a turn the model did not sample as a whole: recorded as delivered.
    assert accepted["content"] != content
    delivered = json.loads(overlay_of(second)["delivered"])["choices"][0]["message"]
    assert delivered["content"] == content
    assert delivered["tool_calls"] == accepted["tool_calls"]
    assert overlay_of(first).get("delivered") is None

    # The harness goes on from what it got. Trained tokens stay exactly the sampled ones:
    # the vetoed attempt (whose text the harness kept) in its own row, the accepted one in
    # the main row, and the next call, whose prompt holds a turn no call sampled whole,
    # in a new row (non_prefix), as after a rewrite.
    turn = {"role": "assistant", "content": content, "tool_calls": [
        {"id": t["id"], "type": "function",
         "function": {"name": t["name"], "arguments": t["arguments"]}} for t in tool_calls]}
    result = {"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": "Fact 1."}
    chat(gated_proxy, "live", [SYSTEM, QUESTION, turn, result], stream=False)
    calls = {c["call_id"]: c for c in gated_proxy.calls("live")}
    rows = trajectories(gated_proxy, tmp_path, "live")
    assert sorted((r["split_reason"] or "", len(r["call_ids"])) for r in rows) == [
        ("", 1), ("non_prefix", 1), ("vetoed", 1)]
    for row in rows:
        trained = [t for t, m in zip(row["response_ids"], row["response_mask"]) if m]
        assert trained == [t for i in row["call_ids"]
                           for t in calls[i]["choices"][0]["completion_ids"]]
    by_reason = {r["split_reason"]: r["call_ids"] for r in rows}
    assert (by_reason["vetoed"], by_reason[None]) == ([first["call_id"]], [second["call_id"]])
    # The calls dataset carries each call's overlay record as stored.
    exported = pq.read_table(tmp_path / "live" / "calls").to_pylist()
    assert {r["call_id"]: r["overlay"] for r in exported} == {
        i: c["overlay"] for i, c in calls.items()}
    assert json.loads(exported[-1]["overlay"])["name"] == "gated"


def test_a_reply_without_tool_calls_streams_live_and_is_not_judged(gated_proxy):
    gated = gated_proxy.state.overlays.loaded["gated"]
    register(gated_proxy, "live-text", overlay="gated")
    content, tool_calls = _live_chat(gated_proxy, "live-text", gated.gate, tools=None)
    assert chat(gated_proxy, "live-text", [SYSTEM, QUESTION], stream=False)[0]
    calls = gated_proxy.calls("live-text")
    assert (content, tool_calls) == (_sampled(calls[0])["content"], [])
    assert [c["status"] for c in calls] == ["ok", "ok"]
    assert gated.opened == [] and events(calls) == []


def test_a_tool_calls_only_rewrite_replaces_the_calls_after_the_live_text(gated_proxy):
    register(gated_proxy, "live-rewrite", overlay="toolrewriter")
    content, tool_calls = _live_chat(gated_proxy, "live-rewrite", threading.Event())
    (call,) = gated_proxy.calls("live-rewrite")
    sampled = _sampled(call)
    assert content == sampled["content"]  # the text went out live, as sampled
    assert [t["arguments"] for t in tool_calls] == ['{"step":1}']
    assert [t["id"] for t in tool_calls] == [t["id"] for t in sampled["tool_calls"]]
    delivered = json.loads(overlay_of(call)["delivered"])["choices"][0]["message"]
    assert (delivered["content"], delivered["tool_calls"][0]["function"]["arguments"]) == (
        content, '{"step":1}')
    assert events([call]) == [("after_model", "rewrite")]


def test_failing_closed_after_live_text_cuts_the_stream(loop_thread, engine, db_url, tmp_path):
    """The client has text already, so the failure cannot be an error reply: the stream
    ends abruptly, as when an upstream breaks mid-stream, and the record says why."""
    p = _proxy(loop_thread, engine, db_url, tmp_path, overlay_fail="closed")
    try:
        register(p, "live-closed", overlay="toolraiser")
        received = threading.Event()
        with pytest.raises(openai.APIConnectionError):
            _live_chat(p, "live-closed", received)
        assert received.is_set()  # the text before the tool call had arrived
        (call,) = p.calls("live-closed")
        assert call["status"] == "overlay_failed"
        assert "overlay 'toolraiser' failed in after_model" in call["error"]
    finally:
        p.stop()


def test_an_upstream_breaking_after_live_text_cuts_the_stream_and_is_an_upstream_error(proxy):
    """Not the overlay's failure: the record says the upstream broke (``CallReview.failed``
    is given the relay's 502, after the client's stream began)."""
    register(proxy, "live-broken", overlay="toolrewriter")
    received = threading.Event()
    with pytest.raises(openai.APIConnectionError):
        _live_chat(proxy, "live-broken", received, mock_fail_after_chunks=3)
    assert received.is_set()
    (call,) = proxy.calls("live-broken")
    assert call["status"] == "upstream_error"
    assert call["error"].startswith("upstream failed mid-reply: ")


# The mock engine writes text before this tool call (its sampling is seeded by the prompt).
RESPONSES_TOOL = {"type": "function", "name": "lookup", "description": "Look up one fact.",
                  "parameters": TOOLS[0]["function"]["parameters"]}
MESSAGES_TOOL = {"name": "lookup", "description": "Look up one fact.",
                 "input_schema": TOOLS[0]["function"]["parameters"]}


def _strings(value) -> list[str]:
    """Every string in a decoded JSON value."""
    if isinstance(value, str):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(
        value, list) else ()
    return [s for item in items for s in _strings(item)]


def _tool_arguments(call: dict) -> list:
    """The arguments (decoded) of the tool calls in a stored Responses or Messages reply."""
    reply = json.loads(call["response"])
    return [json.loads(i["arguments"]) if i["type"] == "function_call" else i["input"]
            for i in reply.get("output") or reply.get("content")
            if i["type"] in ("function_call", "tool_use")]


def test_translated_streams_stay_well_formed_with_live_text_and_a_veto(
        loop_thread, engine, db_url, tmp_path):
    """Responses and Messages clients (the SDKs parse every event) get the first
    attempt's text live, then the re-sample's tool call, in their own API."""
    proxy = _proxy(loop_thread, engine, db_url, tmp_path, translate="all", overlay_timeout=10)
    try:
        proxy.state.overlays.loaded["gated"].gate.set()
        register(proxy, "responses-live", overlay="gated")
        register(proxy, "messages-live", overlay="gated")
        sdk = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
        with sdk, sdk.responses.stream(
                model="mock-model", instructions="Answer.", input="What is it?",
                tools=[RESPONSES_TOOL],
                extra_headers=episode_headers(proxy.url, "responses-live")) as stream:
            response = stream.get_final_response()
        text = response.output_text
        (function_call,) = [o for o in response.output if o.type == "function_call"]
        client = anthropic.Anthropic(base_url=proxy.episode_url("messages-live")[:-3],
                                     api_key="unused", max_retries=0)
        with client, client.messages.stream(
                model="mock-model", max_tokens=256, system="Answer.",
                messages=[{"role": "user", "content": "What is it?"}],
                tools=[MESSAGES_TOOL]) as stream:
            message = stream.get_final_message()
        blocks = {b.type: b for b in message.content}
        for episode, got_text, got_arguments in [
                ("responses-live", text, json.loads(function_call.arguments)),
                ("messages-live", blocks["text"].text, blocks["tool_use"].input)]:
            first, second = proxy.calls(episode)
            assert (first["status"], second["status"]) == ("vetoed", "ok")
            # The client's text is the first attempt's; its tool call the re-sample's.
            assert got_text and got_text in _strings(json.loads(first["response"]))
            delivered = json.loads(overlay_of(second)["delivered"])
            assert got_text in _strings(delivered)
            assert [got_arguments] == _tool_arguments(second) != _tool_arguments(first)
    finally:
        proxy.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_the_first_call_translate_auto_falls_back_for_runs_the_hooks(
        loop_thread, db_url, tmp_path, stream):
    """An upstream taken for vLLM that lacks the Responses API: the first Responses call
    is answered 404, translated to chat, and then runs under the overlay like the rest."""
    engine = EngineServer(EngineConfig(flavor="llama-server"))  # no /v1/responses: 404
    loop_thread.run(engine.start())
    proxy = _proxy(loop_thread, engine, db_url, tmp_path, upstream_flavor="vllm")
    try:
        register(proxy, f"fallback-{stream}", overlay="rewriter")
        with openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0) as sdk:
            texts = _responses(sdk, stream, f"fallback-{stream}", f"fallback-{stream}")
        assert texts == ["Rewritten by the overlay."] * 2
        first, second = proxy.calls(f"fallback-{stream}")
        assert first["endpoint"] == second["endpoint"] == "responses:chat"
        # The native request (answered 404) was not covered; the translated one was.
        assert events([first]) == [("before_model", "not_covered"), ("after_model", "rewrite")]
        assert events([second]) == [("after_model", "rewrite")]
    finally:
        proxy.stop()
        loop_thread.run(engine.close())


# ---- overlays come from the operator's code only --------------------------------------------

def test_overlays_cannot_be_loaded_or_named_freely_through_the_api(proxy):
    for name in ("tests.overlay_fixtures:raiser", "os:system", "unknown"):
        status, body = proxy.admin("POST", "/tracetap/episodes", {"overlay": name})
        assert status == 400 and body["error"]["code"] == "unknown_overlay", body
        assert "noter" not in body["error"]["message"]  # what is loaded is never listed
        with pytest.raises(openai.BadRequestError, match="chosen by the operator"):
            chat(proxy, "by-header", [QUESTION], stream=False, headers={
                "X-Tracetap-Overlay": name})
    status, body = proxy.admin("POST", "/tracetap/episodes",
                               {"metadata": {"overlay": "validator"}})
    assert status == 400 and body["error"]["code"] == "overlay_in_metadata"
    refused = proxy.calls("by-header")  # recorded as refused, never sent upstream
    assert [(c["status"], c["http_status"], c["choices"]) for c in refused] == [
        ("bad_request", 400, [])] * 3


def test_the_header_opts_no_episode_in(proxy):
    """Only the operator chooses an overlay (registration): the agent's header naming a
    loaded one is refused too (tests/test_hostile_episode_trust.py)."""
    with pytest.raises(openai.BadRequestError) as refused:
        chat(proxy, "by-header", [SYSTEM, QUESTION], stream=False,
             headers={"X-Tracetap-Overlay": "noter"})
    assert refused.value.code == "overlay_header"
    (call,) = proxy.calls("by-header")
    assert call["overlay"] is None and call["upstream_request"] is None


def test_loading_mistakes_are_clear_at_start():
    for spec, message in [("x", "use NAME=package.module:factory"),
                          ("x=no_such_module:f", "cannot import no_such_module"),
                          ("x=tests.overlay_fixtures:nothing", "has no callable"),
                          ("x=tests.overlay_fixtures:not_async", "must be an async function"),
                          ("x=tracetap.proxy.overlays.examples:constraint_reminder,path=/nonexistent",
                           "failed"),
                          ("x=tests.overlay_fixtures:sees_everything",
                           "after_model_sees is 'everything'")]:
        with pytest.raises(ValueError, match=message):
            load_overlays([spec])
    out = subprocess.run([sys.executable, "-m", "tracetap", "serve", "--upstream",
                          "http://127.0.0.1:9", "--overlay", "x=no_such_module:f"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("tracetap: error: --overlay x:")


def test_concurrent_first_calls_start_the_episode_once(proxy):
    register(proxy, "together", overlay="noter")

    async def both():
        async with openai.AsyncOpenAI(base_url=proxy.episode_url("together"),
                                      api_key="unused", max_retries=0) as sdk:
            return await asyncio.gather(*(sdk.chat.completions.create(
                model="mock-model", messages=[SYSTEM, QUESTION]) for _ in range(4)))

    proxy.loop.run(both())
    calls = proxy.calls("together")
    # One start, one note: the four calls share the state (calls counted 1..4).
    assert events(calls).count(("before_model", "inject")) == 1
    assert sum(1 for c in calls if c["upstream_request"] and NOTE in c["upstream_request"]) == 4


def test_a_vetoed_attempt_is_not_a_failed_call_in_the_packets(proxy):
    """The vetoer's first attempt is stored with status vetoed (an answer the overlay sent
    back, not an error): a solved episode gets no packet, an unsolved one fails as
    unsuccessful only, with no call errors."""
    from tracetap.analysis.packets import Options, build
    from tracetap.storage.scan import EpisodeFilter

    for episode, reward in (("veto-solved", 1.0), ("veto-unsolved", 0.0)):
        register(proxy, episode, overlay="vetoer", task_id=episode)
        chat(proxy, episode, [SYSTEM, QUESTION], stream=False)
        proxy.flush()
        assert [c["status"] for c in proxy.calls(episode)] == ["vetoed", "ok"]
        finish(proxy, episode, reward)
    result = build(proxy.settings.db, EpisodeFilter(), Options(), readers())
    [packet] = result.packets
    assert packet.episode_id == "veto-unsolved"
    assert packet.outcome.failure == ["unsuccessful"] and packet.outcome.call_errors == []
