"""Opt-in history repair: harness reformatting no longer splits episodes; edits still do."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
from helpers import harnesses as h
from helpers.http import finish, metrics_text, register
from helpers.loop import free_port
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetap.exporters import export
from tracetap.proxy.episodes.repair import Repair
from tracetap.proxy.runtime.settings import Settings

REPAIRED = {"langchain": h.reserialized, "strip": h.stripped, "smolagents": h.text_parts}
EXPLAINED = {"dropper": (h.dropped, "assistant_turn_dropped"),
             "summariser": (h.summarised, "history_compacted")}


def trajectories(proxy, tmp_path, *episodes: str) -> dict[str, list[dict]]:
    for episode in episodes:
        finish(proxy, episode)
    proxy.flush()
    export(proxy.settings.db, tmp_path / "out")
    rows = pq.read_table(tmp_path / "out" / "trajectories").to_pylist()
    return {e: [r for r in rows if r["episode_id"] == e] for e in episodes}


def repairs_metric(proxy) -> dict[str, float]:
    lines = metrics_text(proxy.url).splitlines()
    return {line.split('cause="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in lines if line.startswith("tracetap_history_repairs_total{")}


def run(proxy, episode: str, style, **kwargs) -> list[dict]:
    """Three turns with the tool, or two text turns ending in a newline for "strip*"."""
    extra = {"mock_content": "Done.\n"} if episode.startswith("strip") else None
    tools = None if episode.startswith("strip") else h.TOOLS
    return h.run_episode(proxy, episode, style, turns=2 if extra else 3, extra=extra,
                         tools=tools, system={"role": "system", "content": "Be brief."},
                         **kwargs)


def test_reformatting_harnesses_give_one_trajectory_equal_to_a_faithful_one(proxy, tmp_path):
    """Each style next to a faithful twin (the same conversation, resent as returned)."""
    histories = {}
    for name, style in REPAIRED.items():
        register(proxy, name, repair_history=True, harness={"name": name})
        register(proxy, name + "-twin")
        histories[name] = run(proxy, name, style, task=name)
        # The same task resent as returned: the engine's own tokens for this conversation.
        histories[name + "-twin"] = run(proxy, name + "-twin", h.faithful, task=name)
    rows = trajectories(proxy, tmp_path, *histories)
    for name in REPAIRED:
        [row], [twin] = rows[name], rows[name + "-twin"]
        assert row["split_reason"] is None and row["num_turns"] == twin["num_turns"] > 1
        calls = proxy.calls(name)
        last = calls[-1]
        # One trajectory, exactly the engine's own tokens: prompt + completion of the last
        # call, and the same response tokens and mask as the faithful twin's.
        assert row["prompt_ids"] + row["response_ids"] == (
            last["prompt_ids"] + last["choices"][0]["completion_ids"])
        assert row["response_ids"] == twin["response_ids"]
        assert row["response_mask"] == twin["response_mask"]
        # The harness got the same replies as the faithful twin (it sees no difference).
        assert [m for m in histories[name] if m["role"] == "assistant"] == [
            m for m in histories[name + "-twin"] if m["role"] == "assistant"]
        # Both views stored: what the harness sent, and what the engine was given.
        second = calls[1]
        sent = json.loads(second["request"])["messages"]
        given_ = json.loads(second["upstream_request"])["messages"]
        assert sent == REPAIRED[name](histories[name][:len(sent)])  # the harness's own view
        assert given_[2] == histories[name][2] != sent[2]  # the model's turn, put back
        assert given_[:2] + given_[3:] == sent[:2] + sent[3:]  # nothing else touched
        assert calls[0]["upstream_request"] is None  # nothing to repair in the first turn
    assert set(repairs_metric(proxy)) == {"tool_args_reserialized", "whitespace_changed",
                                          "content_parts"}


def test_meaning_changing_edits_are_never_repaired_only_explained(proxy, tmp_path):
    for name, (style, _) in EXPLAINED.items():
        register(proxy, name, repair_history=True)
        h.run_episode(proxy, name, style, turns=2)
    rows = trajectories(proxy, tmp_path, *EXPLAINED)
    for name, (_, cause) in EXPLAINED.items():
        splits = [r for r in rows[name] if r["split_reason"] == "non_prefix"]
        assert [r["drift_cause"] for r in splits] == [cause]
        assert all(c["upstream_request"] is None for c in proxy.calls(name))
    assert repairs_metric(proxy) == {}


def test_repair_is_off_unless_asked_and_on_for_every_episode_with_the_flag(
        loop_thread, engine, db_url, tmp_path, proxy, make_repairing_proxy):
    register(proxy, "plain")
    run(proxy, "plain", h.reserialized)  # the default proxy: off
    assert all(c["upstream_request"] is None for c in proxy.calls("plain"))
    repairing = make_repairing_proxy()
    run(repairing, "anyone", h.reserialized)  # never registered: the flag applies
    calls = repairing.calls("anyone")
    assert calls[0]["upstream_request"] is None and calls[1]["upstream_request"] is not None
    register(repairing, "opted-out", repair_history=False)
    run(repairing, "opted-out", h.reserialized)
    assert all(c["upstream_request"] is None for c in repairing.calls("opted-out"))


@pytest.fixture
def make_repairing_proxy(loop_thread, engine, db_url, tmp_path):
    from helpers.servers import Proxy

    started = []

    def make():
        settings = Settings(upstream=engine.url, db=db_url, port=free_port(),
                            data_dir=str(tmp_path / "data2"), repair_history=True)
        started.append(Proxy(loop_thread, settings).start())
        return started[-1]

    yield make
    for p in started:
        p.stop()


# ---- property: a history that matches is never touched ----------------------------------

_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                     | _text, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(_text, inner, max_size=3), max_leaves=6)


@st.composite
def replies(draw) -> dict:
    message: dict = {"role": "assistant", "content": draw(st.none() | _text)}
    calls = draw(st.lists(st.tuples(_text, _json, st.sampled_from(
        [(",", ":"), (", ", ": ")])), max_size=2))
    if calls:
        message["tool_calls"] = [
            {"id": f"call-{i}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args, separators=seps)}}
            for i, (name, args, seps) in enumerate(calls)]
    if not (message["content"] or calls):
        message["content"] = "x"
    return message


def remembered(episode: str, originals: list[dict]) -> Repair:
    repair = Repair(default=True)
    for message in originals:
        capture = SimpleNamespace(reassembled=lambda with_logprobs, m=message: {
            "choices": [{"message": m}]})
        repair.remember(episode, True, True, capture)
    return repair


@settings(max_examples=200, deadline=None)
@given(st.lists(replies(), min_size=1, max_size=5), st.lists(_text, max_size=4))
def test_repair_never_changes_a_request_whose_history_matches(originals, others):
    repair = remembered("ep", originals)
    messages = [{"role": "system", "content": "s"}]
    for i, original in enumerate(originals):
        messages.append(copy.deepcopy(original))
        messages.append({"role": "user", "content": others[i] if i < len(others) else "next"})
    payload = {"model": "m", "messages": messages}
    before = copy.deepcopy(payload)
    assert repair.apply("ep", True, payload) is False
    assert payload == before


@settings(max_examples=200, deadline=None)
@given(replies(), _json)
def test_repair_never_puts_back_a_turn_whose_meaning_changed(original, other):
    repair = remembered("ep", [original])
    edited = copy.deepcopy(original)
    if edited.get("tool_calls"):
        before = json.loads(edited["tool_calls"][0]["function"]["arguments"])
        if json.dumps(before, sort_keys=True) == json.dumps(other, sort_keys=True):
            return
        edited["tool_calls"][0]["function"]["arguments"] = json.dumps(other)
    else:
        edited["content"] = (edited["content"] or "") + " and more"
    payload = {"messages": [{"role": "user", "content": "u"}, edited]}
    assert repair.apply("ep", True, payload) is False and payload["messages"][1] == edited


def test_two_turns_that_normalise_alike_are_not_guessed_between():
    a = {"role": "assistant", "content": "Done.\n"}
    b = {"role": "assistant", "content": "Done. "}
    repair = remembered("ep", [a, b])
    payload = {"messages": [{"role": "assistant", "content": "Done."}]}
    assert repair.apply("ep", True, payload) is False
    single = remembered("ep", [a])
    assert single.apply("ep", True, payload) is True and payload["messages"][0] == a
