"""Every split says why: harness-style resends through the proxy, explained at export."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from helpers import harnesses as h
from helpers.http import finish, register

from tests.test_trajectories import make_call
from tracetap import cli
from tracetap.exporters import export
from tracetap.exporters.drift import explain, reply_message
from tracetap.exporters.history import CAUSES, history_cause, turn, turn_cause
from tracetap.exporters.trajectories import build_trajectories
from tracetap.storage.scan import ScannedCall

# (style, turns, extra body, stop, the cause of each split)
STYLES = {
    "langchain": (h.reserialized, 3, None, None, "tool_args_reserialized"),
    "strip": (h.stripped, 2, {"mock_content": "Done.\n"}, None, "whitespace_changed"),
    "smolagents": (h.text_parts, 3, None, None, "content_parts"),
    "dropper": (h.dropped, 2, None, None, "assistant_turn_dropped"),
    "summariser": (h.summarised, 2, None, None, "history_compacted"),
    "stopper": (h.faithful, 2, None, ["."], "stop_string_cut"),
}


@pytest.fixture
def mixed_export(proxy, tmp_path):
    """One episode per harness style, plus a faithful one and a sub-agent; exported."""
    for name, (style, turns, extra, stop, _) in STYLES.items():
        register(proxy, name, harness={"name": name})
        h.run_episode(proxy, name, style, turns=turns, extra=extra, stop=stop,
                      tools=None if name in ("strip", "stopper") else h.TOOLS)
        finish(proxy, name)
    register(proxy, "faithful", harness={"name": "faithful"})
    h.run_episode(proxy, "faithful", h.faithful, turns=3)
    h.run_episode(proxy, "faithful", h.faithful, turns=1, tools=None,
                  system={"role": "system", "content": "You are a sub-agent."})
    finish(proxy, "faithful")
    proxy.flush()
    summary = export(proxy.settings.db, tmp_path / "out")
    rows = pq.read_table(tmp_path / "out" / "trajectories").to_pylist()
    return rows, summary, tmp_path / "out"


def test_each_harness_style_splits_with_its_cause_at_the_first_diverging_token(
        proxy, mixed_export):
    rows, summary, _ = mixed_export
    calls = {c["call_id"]: c for name in [*STYLES, "faithful"] for c in proxy.calls(name)}
    for name, (*_, cause) in STYLES.items():
        mine = [r for r in rows if r["episode_id"] == name]
        main = [r for r in mine if r["split_reason"] is None]
        splits = [r for r in mine if r["split_reason"] == "non_prefix"]
        assert len(main) == 1 and len(splits) == len(mine) - 1 >= 1, name
        for row in splits:
            assert row["drift_cause"] == cause, (name, row["drift_cause"])
            new, old = calls[row["call_ids"][0]], calls[row["drift_call_id"]]
            context = old["prompt_ids"] + old["choices"][0]["completion_ids"]
            at = row["drift_position"]
            # The first token where the new prompt leaves the model's own context.
            assert new["prompt_ids"][:at] == context[:at]
            assert row["drift_received_token"] == new["prompt_ids"][at]
            assert row["drift_expected_token"] == context[at]
            assert new["prompt_ids"][at] != context[at]
    first = next(r for r in rows if r["episode_id"] == "langchain" and r["split_reason"])
    assert first["drift_message_index"] == 2  # system, user, then the model's turn
    assert '"q":' in first["drift_expected_text"] and '"q": ' in first["drift_received_text"]
    # The sub-agent (a system prompt of its own) is a lineage of its own, not a
    # system_changed split: both rows are their lineage's main line (exporters.lineages).
    faithful = [r for r in rows if r["episode_id"] == "faithful"]
    assert [r["split_reason"] for r in faithful] == [None, None]
    main, sub = sorted(faithful, key=lambda r: -r["num_turns"])
    assert (main["num_turns"], sub["num_turns"]) == (3, 1)
    assert sub["parent_lineage_id"] == main["lineage_id"] != sub["lineage_id"]
    assert summary.splits == {"tool_args_reserialized": 2, "whitespace_changed": 1,
                              "content_parts": 2, "assistant_turn_dropped": 1,
                              "history_compacted": 1, "stop_string_cut": 1}


def test_drift_command_explains_every_split_as_json_and_a_table(mixed_export, capsys):
    rows, _, out = mixed_export
    assert cli.main(["drift", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    split_rows = [r for r in rows if r["split_reason"] == "non_prefix"]
    assert report["splits"] == len(split_rows)
    assert report["by_cause"]["tool_args_reserialized"] == 2
    assert report["by_harness"]["smolagents"] == {"content_parts": 2}
    explained = {s["trajectory_id"]: s["cause"] for e in report["episodes"]
                 for s in e["splits"]}
    assert explained == {r["trajectory_id"]: r["drift_cause"] for r in split_rows}
    assert cli.main(["drift", str(out)]) == 0
    table = capsys.readouterr().out
    assert "tool_args_reserialized" in table and "langchain" in table
    assert "assistant_turn_dropped" in table.split("by episode")[1]


def test_export_metrics_file_counts_splits_by_cause(proxy, mixed_export, tmp_path):
    assert cli.main(["export", "--db", proxy.settings.db, "--out", str(tmp_path / "again"),
                     "--no-progress", "--metrics-file", str(tmp_path / "m.prom")]) == 0
    text = (tmp_path / "m.prom").read_text()
    assert 'tracetap_trajectory_splits_total{cause="content_parts"} 2.0' in text
    assert 'tracetap_trajectory_splits_total{cause="stop_string_cut"} 1.0' in text


# ---- the message comparison on its own ---------------------------------------------------

def assistant(content, *calls, **extra):
    message = {"role": "assistant", "content": content, **extra}
    if calls:
        message["tool_calls"] = [{"id": f"c{i}", "type": "function",
                                  "function": {"name": "f", "arguments": a}}
                                 for i, a in enumerate(calls)]
    return message


@pytest.mark.parametrize(("resent", "cause"), [
    (assistant("Hi.\n", '{"a":1}'), None),
    (assistant("Hi.\n", '{"a": 1}'), "tool_args_reserialized"),
    (assistant("Hi.", '{"a":1}'), "whitespace_changed"),
    (assistant([{"type": "text", "text": "Hi.\n"}], '{"a":1}'), "content_parts"),
    (assistant("Hi.\nCalling tools:\n[{'id': 'c0', 'function': {'name': 'f', "
               "'arguments': {'a': 1}}}]"), "tool_calls_as_text"),
    (assistant("Hi.\n", '{"a":2}'), "assistant_turn_edited"),
    (assistant("Hi.\n", '{"a":1.0}'), "assistant_turn_edited"),  # 1.0 is not 1
    (assistant("Hello.\n", '{"a":1}'), "assistant_turn_edited"),
    (assistant("Hi.\nCalling tools:\n[{'function': {'name': 'f', 'arguments': {'a': 9}}}]"),
     "assistant_turn_edited"),
])
def test_turn_cause_follows_the_normalisation_rules(resent, cause):
    assert turn_cause(turn(assistant("Hi.\n", '{"a":1}')), turn(resent)) == cause


def test_reasoning_stripped_and_history_causes():
    thought = assistant("Hi.", reasoning_content="Let me think.")
    assert turn_cause(turn(thought), turn(assistant("Hi."))) == "reasoning_stripped"
    system, user = {"role": "system", "content": "S"}, {"role": "user", "content": "U"}
    reply = assistant("A")
    expected = [system, user, reply]
    assert history_cause(expected, [*expected, {"role": "user", "content": "more"}], 2) == (
        "template_drift", 3)
    assert history_cause(expected, [system, user, {"role": "user", "content": "x"}], 2) == (
        "assistant_turn_dropped", 2)
    assert history_cause(expected, [system, user], 2) == ("assistant_turn_dropped", 2)
    assert history_cause(expected, [system, {"role": "user", "content": "sum"}], 2) == (
        "history_compacted", 1)
    assert history_cause(expected, [{"role": "system", "content": "T"}, user, reply], 2) == (
        "system_changed", 0)
    edited = [system, {"role": "user", "content": "V"}, reply, user]
    assert history_cause(expected, edited, 2) == ("history_edited", 1)
    assert set(CAUSES) >= {"tool_args_reserialized", "whitespace_changed", "content_parts",
                           "assistant_turn_dropped", "assistant_turn_edited",
                           "reasoning_stripped", "history_compacted", "system_changed",
                           "template_drift"}


def test_replies_of_translated_calls_compare_as_chat_messages():
    anthropic = {"type": "message", "content": [
        {"type": "text", "text": "Hi."},
        {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]}
    message = reply_message(anthropic, 0)
    assert turn_cause(turn(message), turn(assistant("Hi.", '{"a": 1}') | {
        "tool_calls": [{"id": "t1", "type": "function",
                        "function": {"name": "f", "arguments": '{"a": 1}'}}]})) is None
    responses = {"object": "response", "output": [
        {"type": "message", "content": [{"type": "output_text", "text": "Hi."}]},
        {"type": "function_call", "call_id": "c0", "name": "f", "arguments": '{"a":1}'}]}
    assert turn_cause(turn(reply_message(responses, 0)), turn(assistant("Hi.", '{"a":1}'))) is None


def test_rows_without_bodies_or_without_an_earlier_turn_say_so():
    calls = [make_call("a", 0, [1, 2], [[3]]), make_call("b", 0.5, [1, 4], [[5]]),
             make_call("c", 2, [1, 9], [[6]])]
    rows = build_trajectories(calls)
    by_leaf = {r.call_ids[0]: r for r in rows}
    assert by_leaf["b"].drift_cause == "no_earlier_turn"  # "a" had not finished yet
    c = by_leaf["c"]
    assert (c.drift_call_id, c.drift_position, c.drift_expected_token,
            c.drift_received_token) == ("b", 1, 4, 9)  # shares most with "b"
    explain(c, {})
    assert c.drift_cause == "unknown"
    bodies = {"c": ScannedCall(call_id="c", request='{"prompt": "xy"}'),
              "b": ScannedCall(call_id="b", request='{"prompt": "x"}',
                               response=json.dumps({"choices": [{"index": 0, "text": "y"}]}))}
    c.drift_cause = None
    explain(c, bodies)
    assert c.drift_cause == "template_drift"  # the text agrees, the tokens do not
