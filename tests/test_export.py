"""End to end: the openai SDK drives a tool-use agent through tracetap, then we export.

Every test runs on SQLite and on Postgres (the ``db_url`` fixture behind ``proxy``).
"""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import openai
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from sqlalchemy import text

from tracetap import __version__, cli, exporters
from tracetap.demo.engine import EngineConfig
from tracetap.exporters import CALLS_SCHEMA, SCHEMA_VERSION, TRAJECTORIES_SCHEMA, Progress, export
from tracetap.exporters import schema as export_schema
from tracetap.exporters.adapters import (
    ADAPTERS,
    UntrainableRow,
    to_openrlhf,
    to_slime,
    to_trl,
    to_verl,
)
from tracetap.exporters.command import ProgressBar, timestamp
from tracetap.storage import queries
from tracetap.storage.engine import create_engine

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "parameters": {"type": "object", "properties": {"step": {"type": "integer"}}},
}}]
DESIGN_CALL_COLUMNS = [
    "call_id", "episode_id", "group_id", "task_id", "seq", "t_start", "t_end", "endpoint",
    "model", "policy_version", "request", "response", "prompt_ids", "completion_ids",
    "completion_logprobs", "token_source", "finish_reason", "status", "error",
    "prompt_tokens", "completion_tokens", "reward"]
DESIGN_TRAJECTORY_COLUMNS = [
    "trajectory_id", "episode_id", "group_id", "task_id", "call_ids", "prompt_ids",
    "response_ids", "response_mask", "response_logprobs", "num_turns", "split_reason",
    "policy_versions", "reward", "outcome", "harness", "harness_config"]


# ---- the agent ---------------------------------------------------------------------------

def admin(proxy, method: str, path: str, body: dict | None = None) -> dict:
    status, reply = proxy.admin(method, path, body or {})
    assert status < 300, reply
    return reply


def _streamed(chunks) -> tuple[str | None, list[dict]]:
    content, tools = "", {}
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                tool = tools.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                tool["id"] = call.id or tool["id"]
                tool["name"] += call.function.name or ""
                tool["arguments"] += call.function.arguments or ""
    calls = [{"id": t["id"], "type": "function",
              "function": {"name": t["name"], "arguments": t["arguments"]}}
             for _, t in sorted(tools.items())]
    return content or None, calls


def turn(client, messages: list[dict], *, stream: bool = False, choice: int = 0,
         tool_rounds: int = 2, extra: dict | None = None, **kwargs) -> None:
    """One model call; the reply (its choice ``choice``) and the tool results are appended."""
    body = {"mock_tool_rounds": tool_rounds, **(extra or {})}
    reply = client.chat.completions.create(model="mock-model", messages=messages, tools=TOOLS,
                                           stream=stream, extra_body=body, **kwargs)
    if stream:
        content, calls = _streamed(reply)
    else:
        message = reply.choices[choice].message
        content = message.content
        calls = [c.model_dump(include={"id", "type", "function"})
                 for c in message.tool_calls or ()]
    assistant = {"role": "assistant", "content": content}
    if calls:
        assistant["tool_calls"] = calls
    messages.append(assistant)
    for call in calls:
        messages.append({"role": "tool", "tool_call_id": call["id"],
                         "content": f"result of {call['function']['arguments']}"})
    if not calls:
        messages.append({"role": "user", "content": "Thanks. Anything else?"})


def run_episode(proxy, episode: str, turns: int, *, finish: dict | None = None,
                **kwargs) -> list[dict]:
    client = openai.OpenAI(base_url=proxy.episode_url(episode), api_key="x")
    messages = [{"role": "user", "content": f"Solve task {episode}."}]
    with client:
        for i in range(turns):
            turn(client, messages, stream=i % 2 == 1, **kwargs)
    if finish is not None:
        admin(proxy, "POST", f"/tracetap/episodes/{episode}/finish", finish)
    return proxy.calls(episode)


def read(out: Path, dataset: str, episode: str | None = None) -> list[dict]:
    rows = pq.read_table(out / dataset).to_pylist()
    return [r for r in rows if episode is None or r["episode_id"] == episode]


def segments(row: dict, calls: list[dict]) -> list[tuple[tuple[str, int], int]]:
    """Walk a trajectory row against the stored calls: ((call, choice), mask) per turn,
    checking that the row is exactly gap, completion, gap, completion ..."""
    by_id = {c["call_id"]: c for c in calls}
    response, mask = row["response_ids"], row["response_mask"]
    at, end, out = 0, len(row["prompt_ids"]), []
    for call_id, index in zip(row["call_ids"], row["choice_indices"]):
        call = by_id[call_id]
        completion = call["choices"][index]["completion_ids"]
        gap = call["prompt_ids"][end:]
        assert response[at:at + len(gap)] == gap and set(mask[at:at + len(gap)]) <= {0}
        at += len(gap)
        assert response[at:at + len(completion)] == completion
        [bit] = set(mask[at:at + len(completion)])
        logprobs = row["response_logprobs"][at:at + len(completion)]
        stored = call["choices"][index]["completion_logprobs"]
        expected = np.float32(stored) if bit else np.zeros(len(completion), np.float32)
        assert np.array_equal(np.float32(logprobs), expected)
        out.append(((call_id, index), bit))
        at += len(completion)
        end = len(call["prompt_ids"]) + len(completion)
    assert at == len(response)
    return out


# ---- trajectories ------------------------------------------------------------------------

def test_append_only_episode_is_one_exact_trajectory(proxy, tmp_path):
    calls = run_episode(proxy, "five", 5, tool_rounds=4, finish={"reward": 1.0})
    summary = export(proxy.settings.db, tmp_path)
    [row] = read(tmp_path, "trajectories", "five")
    # The summary counts every token id written, in both datasets.
    assert summary.tokens == len(row["prompt_ids"]) + len(row["response_ids"]) + sum(
        len(r["prompt_ids"]) + len(r["completion_ids"]) for r in read(tmp_path, "calls"))
    last = calls[-1]
    assert row["prompt_ids"] + row["response_ids"] == (
        last["prompt_ids"] + last["choices"][0]["completion_ids"])
    assert row["prompt_ids"] == calls[0]["prompt_ids"]
    assert [bit for _, bit in segments(row, calls)] == [1] * 5
    assert sum(row["response_mask"]) == sum(len(c["choices"][0]["completion_ids"])
                                            for c in calls)
    assert row["call_ids"] == [c["call_id"] for c in calls]
    assert row["num_turns"] == 5 and row["split_reason"] is None
    assert row["finish_reason"] == "stop" and row["reward"] == 1.0


def test_a_context_rewrite_in_turn_three_splits_in_two(proxy, tmp_path):
    client = openai.OpenAI(base_url=proxy.episode_url("rewrite"), api_key="x")
    messages = [{"role": "user", "content": "Plan a trip."}]
    with client:
        turn(client, messages, tool_rounds=3)
        turn(client, messages, tool_rounds=3)
        messages = [{"role": "user", "content": "Summary so far: two lookups done."}]
        for _ in range(3):
            turn(client, messages, tool_rounds=3)
    admin(proxy, "POST", "/tracetap/episodes/rewrite/finish", {"reward": 0.0})
    calls = proxy.calls("rewrite")
    export(proxy.settings.db, tmp_path)
    rows = read(tmp_path, "trajectories", "rewrite")
    ids = [c["call_id"] for c in calls]
    assert [(r["call_ids"], r["split_reason"]) for r in rows] == [
        (ids[:2], None), (ids[2:], "non_prefix")]
    for row in rows:
        assert all(bit == 1 for _, bit in segments(row, calls))


def test_samples_and_retries_branch_and_nothing_is_trained_twice(proxy, tmp_path):
    client = openai.OpenAI(base_url=proxy.episode_url("branches"), api_key="x")
    messages = [{"role": "user", "content": "Find it."}]
    with client:
        turn(client, messages, tool_rounds=3)
        turn(client, messages, tool_rounds=3, n=2)  # the agent goes on with choice 0
        retry = list(messages)
        turn(client, messages, tool_rounds=3)
        turn(client, retry, tool_rounds=3)  # the same request again
    admin(proxy, "POST", "/tracetap/episodes/branches/finish", {"reward": 0.5})
    calls = proxy.calls("branches")
    export(proxy.settings.db, tmp_path)
    rows = read(tmp_path, "trajectories", "branches")
    assert sorted(r["split_reason"] or "" for r in rows) == ["", "retry", "sample"]
    trained: dict[tuple[str, int], int] = {}
    for row in rows:
        for key, bit in segments(row, calls):
            trained[key] = trained.get(key, 0) + bit
    every_choice = {(c["call_id"], ch["index"]) for c in calls for ch in c["choices"]}
    assert set(trained) == every_choice
    assert set(trained.values()) == {1}  # each completion is mask 1 in exactly one row


def test_reward_outcome_group_harness_and_policy_columns(proxy, tmp_path):
    admin(proxy, "POST", "/tracetap/episodes", {
        "id": "meta", "group_id": "g-1", "task_id": "task-7",
        "harness": {"name": "swe-agent", "config": {"temperature": 0.7, "retry": True,
                                                    "tools": ["bash"]}}})
    admin(proxy, "PUT", "/tracetap/policy", {"version": "step-42"})
    run_episode(proxy, "meta", 2, finish={"reward": 1.5, "rewards": {"tests": 1.0},
                                          "outcome": "solved"})
    export(proxy.settings.db, tmp_path)
    [row] = read(tmp_path, "trajectories", "meta")
    assert (row["group_id"], row["task_id"], row["reward"], row["outcome"]) == (
        "g-1", "task-7", 1.5, "solved")
    assert row["harness"] == "swe-agent"
    assert json.loads(row["harness_config"]) == {"temperature": 0.7, "retry": True,
                                                 "tools": ["bash"]}
    # Scalar config values are factors (docs/harness-engineering.md); a list is not.
    assert row["harness_factors"] == [{"factor": "retry", "level": "true"},
                                      {"factor": "temperature", "level": "0.7"}]
    assert json.loads(row["rewards"]) == {"tests": 1.0}
    assert row["policy_versions"] == ["step-42", "step-42"]
    for call in read(tmp_path, "calls", "meta"):
        assert (call["group_id"], call["task_id"], call["reward"], call["policy_version"]) == (
            "g-1", "task-7", 1.5, "step-42")


# ---- calls -------------------------------------------------------------------------------

def test_calls_have_one_row_per_choice_and_failures_stay_out_of_trajectories(proxy, tmp_path):
    client = openai.OpenAI(base_url=proxy.episode_url("rows"), api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Hi."}]
    with client:
        turn(client, messages, n=2)
        with pytest.raises(openai.InternalServerError):
            turn(client, list(messages), extra={"mock_status": 500})
        turn(client, messages, stream=True)
    admin(proxy, "POST", "/tracetap/episodes/rows/finish", {})
    stored = proxy.calls("rows")
    export(proxy.settings.db, tmp_path)
    table = pq.read_table(tmp_path / "calls")
    assert [n for n in table.schema.names if n in DESIGN_CALL_COLUMNS] == DESIGN_CALL_COLUMNS
    assert table.schema.field("prompt_ids").type == pa.list_(pa.int32())
    assert table.schema.field("completion_logprobs").type == pa.list_(pa.float32())
    rows = {(r["call_id"], r["choice_index"]): r for r in table.to_pylist()}
    assert len(rows) == 4  # two choices, one failed call, one streamed call
    for call in stored:
        for choice in call["choices"] or [{"index": None}]:
            row = rows[(call["call_id"], choice["index"])]
            assert row["prompt_ids"] == call["prompt_ids"]
            assert (row["seq"], row["status"], row["http_status"]) == (
                call["seq"], call["status"], call["http_status"])
            assert json.loads(row["request"])["messages"]
            if choice["index"] is not None:
                assert row["completion_ids"] == choice["completion_ids"]
                assert np.array_equal(np.float32(row["completion_logprobs"]),
                                      np.float32(choice["completion_logprobs"]))
                assert row["token_source"] == "engine"
    failed = [r for r in rows.values() if r["http_status"] == 500]
    assert len(failed) == 1 and failed[0]["completion_ids"] is None
    exported = {c for r in read(tmp_path, "trajectories", "rows") for c in r["call_ids"]}
    assert failed[0]["call_id"] not in exported and len(exported) == 2


def test_long_bodies_are_cut_into_batches_between_calls(proxy, tmp_path, monkeypatch):
    client = openai.OpenAI(base_url=proxy.episode_url("long"), api_key="x")
    messages = [{"role": "user", "content": "Hi."}]
    with client:
        turn(client, messages, n=2)
        turn(client, messages)
        turn(client, messages, stream=True)
    admin(proxy, "POST", "/tracetap/episodes/long/finish", {})
    assert len(proxy.calls("long")) == 3  # flushed to the database
    whole = export(proxy.settings.db, tmp_path / "whole")
    # Every call's bodies over the limit: a batch per call, never one per choice.
    monkeypatch.setattr(export_schema, "BODY_CHARS_PER_BATCH", 1)
    cut = export(proxy.settings.db, tmp_path / "cut")
    assert (cut.calls, cut.call_rows, cut.tokens) == (whole.calls, whole.call_rows,
                                                      whole.tokens)
    assert (cut.calls, cut.call_rows) == (3, 4)
    assert read(tmp_path / "cut", "calls") == read(tmp_path / "whole", "calls")


@pytest.mark.parametrize("engine_config", [EngineConfig(flavor="openai")])
def test_calls_without_token_ids_are_left_out_of_trajectories_and_counted(proxy, tmp_path):
    run_episode(proxy, "text-only", 2, finish={"reward": 1.0})
    summary = export(proxy.settings.db, tmp_path)
    assert read(tmp_path, "trajectories", "text-only") == []
    # The OpenAI-like upstream has neither ids nor a tokenizer endpoint: the why is kept.
    assert summary.left_out == {"no_tokenizer": 2}
    calls = read(tmp_path, "calls", "text-only")
    assert {(r["token_source"], r["prompt_source"], r["ids_missing"]) for r in calls} == {
        ("none", "none", "no_tokenizer")}


@pytest.mark.parametrize("engine_config", [EngineConfig(flavor="openai")])
def test_kept_calls_without_token_ids_are_marked_and_refused_by_every_adapter(proxy,
                                                                             tmp_path):
    calls = run_episode(proxy, "text-only", 2, finish={"reward": 1.0})
    summary = export(proxy.settings.db, tmp_path, keep_untokenized=True)
    assert summary.left_out == {}
    rows = read(tmp_path, "trajectories", "text-only")
    assert [r["call_ids"] for r in rows] == [[c["call_id"]] for c in calls]
    assert {r["split_reason"] for r in rows} == {"no_token_ids"}
    assert all(r["prompt_ids"] == [] and r["response_ids"] == [] for r in rows)
    assert {r["reward"] for r in rows} == {1.0}  # the reward is there: adapters must refuse
    for adapt in ADAPTERS.values():
        with pytest.raises(UntrainableRow, match="no token ids"):
            adapt(rows[0])


# The datasets' columns and types as docs/export.md documents them, written out by hand: the
# exporter's own constants cannot be the reference for what it writes.
_TIME, _IDS = pa.timestamp("us", tz="UTC"), pa.list_(pa.int32())
_SPANS = pa.list_(pa.struct([("start", pa.int32()), ("end", pa.int32()),
                             ("version", pa.string())]))
_ROUTING = pa.list_(pa.list_(pa.list_(pa.int16())))
_IMAGES = pa.list_(pa.struct([("sha256", pa.string()), ("media_type", pa.string()),
                              ("url", pa.string()), ("start", pa.int32()), ("end", pa.int32())]))
DOCUMENTED_CALLS = pa.schema([
    ("call_id", pa.string()), ("choice_index", pa.int32()), ("episode_id", pa.string()),
    ("group_id", pa.string()), ("task_id", pa.string()), ("seq", pa.int64()),
    ("t_start", _TIME), ("t_end", _TIME), ("endpoint", pa.string()), ("model", pa.string()),
    ("policy_version", pa.string()), ("request", pa.string()), ("response", pa.string()),
    ("upstream_request", pa.string()), ("overlay", pa.string()), ("prompt_ids", _IDS),
    ("prompt_source", pa.string()),
    ("ids_missing", pa.string()), ("completion_ids", _IDS),
    ("completion_logprobs", pa.list_(pa.float32())), ("token_source", pa.string()),
    ("finish_reason", pa.string()), ("status", pa.string()), ("http_status", pa.int32()),
    ("error", pa.string()), ("prompt_tokens", pa.int32()), ("completion_tokens", pa.int32()),
    ("reward", pa.float64()), ("finish_seq", pa.int32()),
    ("integrity", pa.string()), ("integrity_cause", pa.string()),
    ("lineage_id", pa.string()), ("parent_lineage_id", pa.string()),
    ("policy_spans", _SPANS), ("mixed_policy", pa.bool_()),
    ("routed_experts", _ROUTING), ("images", _IMAGES),
])
DOCUMENTED_TRAJECTORIES = pa.schema([
    ("trajectory_id", pa.string()), ("episode_id", pa.string()), ("group_id", pa.string()),
    ("task_id", pa.string()), ("call_ids", pa.list_(pa.string())),
    ("choice_indices", pa.list_(pa.int32())), ("prompt_ids", _IDS), ("response_ids", _IDS),
    ("response_mask", pa.list_(pa.int8())), ("response_logprobs", pa.list_(pa.float32())),
    ("num_turns", pa.int32()), ("split_reason", pa.string()), ("finish_reason", pa.string()),
    ("policy_versions", pa.list_(pa.string())), ("reward", pa.float64()),
    ("finish_seq", pa.int32()), ("rewards", pa.string()), ("outcome", pa.string()),
    ("harness", pa.string()),
    ("harness_config", pa.string()),
    ("harness_factors", pa.list_(pa.struct([("factor", pa.string()), ("level", pa.string())]))),
    ("drift_cause", pa.string()), ("drift_position", pa.int32()),
    ("drift_expected_token", pa.int32()), ("drift_received_token", pa.int32()),
    ("drift_message_index", pa.int32()), ("drift_expected_text", pa.string()),
    ("drift_received_text", pa.string()), ("drift_call_id", pa.string()),
    ("integrity", pa.string()),
    ("integrity_causes", pa.list_(pa.struct([("cause", pa.string()), ("calls", pa.int32())]))),
    ("lineage_id", pa.string()), ("parent_lineage_id", pa.string()),
    ("continues_trajectory_id", pa.string()), ("summary_call_id", pa.string()),
    ("response_policy_spans", _SPANS), ("mixed_policy", pa.bool_()),
    ("response_routed_experts", _ROUTING), ("images", _IMAGES),
])


def test_the_files_have_the_documented_schema_and_version(proxy, tmp_path):
    run_episode(proxy, "schema", 2, finish={"reward": 1.0})
    export(proxy.settings.db, tmp_path)
    for name, documented in (("calls", DOCUMENTED_CALLS),
                             ("trajectories", DOCUMENTED_TRAJECTORIES)):
        [file] = (tmp_path / name).glob("*.parquet")
        written = pq.read_schema(file)
        assert written.remove_metadata() == documented, name
        # Changing a column means a new schema version, which readers can check.
        assert written.metadata[b"tracetap.schema_version"] == b"6"
        assert written.metadata[b"tracetap.dataset"] == name.encode()


# ---- loading and trainers ----------------------------------------------------------------

def test_loads_with_pyarrow_pandas_and_datasets_and_feeds_every_adapter(proxy, tmp_path):
    run_episode(proxy, "load", 3, finish={"reward": 2.0})
    export(proxy.settings.db, tmp_path / "out")
    out = tmp_path / "out"
    for name, schema in (("calls", CALLS_SCHEMA), ("trajectories", TRAJECTORIES_SCHEMA)):
        dataset = ds.dataset(out / name, format="parquet")
        assert dataset.schema.remove_metadata() == schema
        [file] = dataset.files
        metadata = pq.read_metadata(file)
        assert metadata.metadata[b"tracetap.schema_version"] == SCHEMA_VERSION.encode()
        assert metadata.metadata[b"tracetap.version"] == __version__.encode()
        assert metadata.row_group(0).column(0).compression == "ZSTD"
    frame = pd.read_parquet(out / "trajectories")
    assert list(frame["episode_id"]) == ["load"]
    assert [f for f in frame.columns if f in DESIGN_TRAJECTORY_COLUMNS] == (
        DESIGN_TRAJECTORY_COLUMNS)
    import datasets

    hf = datasets.load_dataset("parquet", data_files=str(out / "trajectories" / "*.parquet"),
                               split="train", cache_dir=str(tmp_path / "hf"))
    row = hf[0]
    n = len(row["response_ids"])
    verl = to_verl(row)
    assert len(verl["response_mask"]) == len(verl["rollout_log_probs"]) == n
    trl = to_trl(row)
    assert trl["completion_ids"] == row["response_ids"] and trl["env_mask"] == (
        row["response_mask"])
    slime = to_slime(row)
    assert slime["tokens"] == row["prompt_ids"] + row["response_ids"]
    assert slime["response_length"] == len(slime["loss_mask"]) == n
    openrlhf = to_openrlhf(frame.iloc[0])  # numpy-backed lists work too
    covered = [i for start, end in openrlhf["action_ranges"] for i in range(start, end)]
    prompt = len(row["prompt_ids"])
    assert covered == [prompt + i for i, bit in enumerate(row["response_mask"]) if bit]
    assert openrlhf["reward"] == 2.0


# ---- runs, incremental, failure ----------------------------------------------------------

def cli_export(db: str, out: Path, *flags: str) -> int:
    return cli.main(["export", "--db", db, "--out", str(out), "--no-progress", *flags])


def test_incremental_export_appends_only_new_episodes(proxy, tmp_path, capsys):
    db, out = proxy.settings.db, tmp_path / "data"
    run_episode(proxy, "first", 2, finish={"reward": 1.0})
    assert cli_export(db, out, "--incremental") == 0
    assert "exported 1 episode: 2 calls (" in capsys.readouterr().out
    run_episode(proxy, "second", 2, finish={"reward": 0.0})
    run_episode(proxy, "unfinished", 1)
    assert cli_export(db, out, "--incremental") == 0
    assert "exported 1 episode: " in capsys.readouterr().out
    assert cli_export(db, out, "--incremental") == 0
    assert "exported 0 episodes: " in capsys.readouterr().out
    rows = read(out, "trajectories")
    assert sorted(r["episode_id"] for r in rows) == ["first", "second"]
    assert len({r["trajectory_id"] for r in rows}) == 2
    assert sorted(r["episode_id"] for r in read(out, "calls")) == ["first"] * 2 + ["second"] * 2
    manifest = json.loads((out / "_manifest.json").read_text())
    assert [run["episodes"] for run in manifest["runs"]] == [1, 1, 0]
    assert len(list((out / "trajectories").glob("*.parquet"))) == 2  # the empty run adds none

    assert cli_export(db, out) == 1  # a plain run would duplicate: refused, clearly
    assert "--incremental" in capsys.readouterr().err
    assert cli_export(db, out, "--incremental", "--group", "g") == 1
    assert "must select what the existing export did" in capsys.readouterr().err
    assert cli_export(db, out, "--overwrite", "--no-finished-only") == 0
    rows = read(out, "trajectories")
    assert sorted(r["episode_id"] for r in rows) == ["first", "second", "unfinished"]
    assert len(list((out / "trajectories").glob("*.parquet"))) == 1


def test_finished_only_is_the_default(proxy, tmp_path):
    run_episode(proxy, "done", 1, finish={"reward": 1.0})
    run_episode(proxy, "running", 1)
    summary = export(proxy.settings.db, tmp_path / "a")
    assert summary.episodes == 1
    assert {r["episode_id"] for r in read(tmp_path / "a", "trajectories")} == {"done"}
    export(proxy.settings.db, tmp_path / "b", finished_only=False, datasets=["trajectories"])
    rows = {r["episode_id"]: r for r in read(tmp_path / "b", "trajectories")}
    assert set(rows) == {"done", "running"} and rows["running"]["reward"] is None
    assert not (tmp_path / "b" / "calls").exists()


def test_a_whole_table_export_includes_calls_outside_any_episode(proxy, tmp_path):
    run_episode(proxy, "tagged", 1, finish={"reward": 1.0})
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x")
    with client:
        for _ in range(2):
            turn(client, [{"role": "user", "content": "No episode here."}])
    [stored, *_] = untagged = proxy.calls(None)
    assert len(untagged) == 2
    summary = export(proxy.settings.db, tmp_path / "all", finished_only=False)
    rows = read(tmp_path / "all", "calls")
    assert sorted(r["call_id"] for r in rows if r["episode_id"] is None) == sorted(
        c["call_id"] for c in untagged)
    row = next(r for r in rows if r["call_id"] == stored["call_id"])
    assert row["prompt_ids"] == stored["prompt_ids"] and row["group_id"] is None
    assert row["completion_ids"] == stored["choices"][0]["completion_ids"]
    assert summary.calls == 3 and summary.trajectories == 1  # untagged calls: no trajectory
    export(proxy.settings.db, tmp_path / "finished")  # finished only: episodes' calls only
    assert {r["episode_id"] for r in read(tmp_path / "finished", "calls")} == {"tagged"}


def test_episode_group_and_time_filters_select_episodes(proxy, tmp_path):
    for episode, group in (("g1-a", "g1"), ("g1-b", "g1"), ("g2-a", "g2")):
        admin(proxy, "POST", "/tracetap/episodes", {"id": episode, "group_id": group})
        run_episode(proxy, episode, 1, finish={"reward": 1.0})
    db = proxy.settings.db

    def episodes(out: Path, **selection) -> list[str]:
        export(db, out, datasets=["trajectories"], **selection)
        return sorted(r["episode_id"] for r in read(out, "trajectories"))

    assert episodes(tmp_path / "group", group="g1") == ["g1-a", "g1-b"]
    assert episodes(tmp_path / "ids", episodes=["g2-a", "g1-b", "nope"]) == ["g1-b", "g2-a"]
    assert episodes(tmp_path / "future", since=datetime.now(timezone.utc)) == []
    assert episodes(tmp_path / "past", until=time.time()) == ["g1-a", "g1-b", "g2-a"]


def test_times_parse_as_iso_8601_or_epoch_seconds(capsys):
    assert timestamp("2025-01-31T12:00:00Z") == timestamp("2025-01-31T12:00:00") == 1738324800
    assert timestamp("1738324800.5") == 1738324800.5
    with pytest.raises(SystemExit):
        cli.main(["export", "--out", "x", "--since", "yesterday"])
    assert "not a time: 'yesterday'" in capsys.readouterr().err


def test_the_progress_bar_redraws_one_line_and_ends_it():
    stream = io.StringIO()
    bar = ProgressBar(stream)
    bar.update(Progress(episodes=5, episodes_total=10, calls=40, trajectories=5,
                        tokens=2_000_000, seconds=1.0))
    bar.close()
    assert stream.getvalue().startswith("\r[############............] 5/10 episodes")
    assert stream.getvalue().endswith("1.0s\n")


def test_an_empty_database_gives_empty_datasets_with_the_full_schema(db_url, tmp_path, capsys):
    assert cli_export(db_url, tmp_path) == 0
    assert ("exported 0 episodes: 0 calls (0 token ids), 0 trajectories (0 token ids, "
            "0 trained), 2 files in ") in capsys.readouterr().out
    for name, schema in (("calls", CALLS_SCHEMA), ("trajectories", TRAJECTORIES_SCHEMA)):
        table = ds.dataset(tmp_path / name, format="parquet").to_table()
        assert table.num_rows == 0 and table.schema.remove_metadata() == schema
        assert list(pd.read_parquet(tmp_path / name).columns) == schema.names


def test_an_unwritable_out_is_a_clear_error_and_leaves_nothing(db_url, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert cli_export(db_url, blocker / "out") == 1
    assert "cannot write to" in capsys.readouterr().err

    out = tmp_path / "out"
    out.mkdir()
    (out / "trajectories").write_text("in the way")  # calls/ gets written, then this fails
    assert cli_export(db_url, out) == 1
    assert "cannot write to" in capsys.readouterr().err
    assert not (out / "_manifest.json").exists()
    assert list((out / "calls").iterdir()) == []  # not even a hidden temp file


def test_a_run_cut_after_its_commit_is_finished_and_strays_are_removed(db_url, tmp_path):
    summary = export(db_url, tmp_path)
    moved = tmp_path / summary.files[0]
    moved.rename(moved.with_name("." + moved.name + ".tmp"))  # killed before the renames
    stray = tmp_path / "calls" / ".part-dead-00000.parquet.tmp"
    stray.write_bytes(b"half a file")
    export(db_url, tmp_path, incremental=True)
    assert moved.exists() and not stray.exists()


def test_an_unreachable_or_unmigrated_database_is_a_clear_error(tmp_path, capsys):
    assert cli_export(f"sqlite:///{tmp_path / 'missing.db'}", tmp_path / "out") == 1
    assert "no database at" in capsys.readouterr().err
    (tmp_path / "blank.db").write_bytes(b"")
    assert cli_export(f"sqlite:///{tmp_path / 'blank.db'}", tmp_path / "out") == 1
    assert "tracetap db upgrade" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # the database is checked before anything is made


def test_a_driver_error_while_reading_is_a_clear_error_and_leaves_nothing(db_url, tmp_path,
                                                                          capsys):
    async def finished_episode_without_calls_table():
        engine = create_engine(db_url)
        try:
            await queries.finish_episode(engine, "e", reward=1.0, rewards=None, outcome=None,
                                         info=None)
            async with engine.begin() as conn:
                await conn.execute(text("DROP TABLE calls"))
        finally:
            await engine.dispose()

    asyncio.run(finished_episode_without_calls_table())
    assert cli_export(db_url, tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert "cannot read" in err and "calls" in err and "Traceback" not in err
    assert not list((tmp_path / "out").rglob("*.parquet"))
    assert not (tmp_path / "out" / "_manifest.json").exists()


# ---- surface -------------------------------------------------------------------------------

def test_the_public_api_is_pinned():
    assert sorted(exporters.__all__) == [
        "ADAPTERS", "CALLS_SCHEMA", "ExportError", "ExportSummary", "Progress",
        "SCHEMA_VERSION", "SPLIT_REASONS", "TRAJECTORIES_SCHEMA", "Trajectory",
        "build_trajectories", "export", "export_async", "files"]
    assert all(getattr(exporters, name) is not None for name in exporters.__all__)


def test_the_command_line_starts_without_pyarrow():
    """`tracetap serve --help` (and the CLI's start) do not pay for pyarrow's import; a
    serving process loads it once at start for its block codec (storage/blocks.py)."""
    code = ("import sys\nfrom tracetap import cli\n"
            "try:\n    cli.main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'pyarrow' not in sys.modules, 'pyarrow imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
