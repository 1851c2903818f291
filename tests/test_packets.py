"""``tracetap packets`` on a seeded database (tests/helpers/seeding.py) of known failures."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import jsonschema
import pyarrow.parquet as pq
import pytest
from helpers.seeding import seed

from tracetap import cli
from tracetap.analysis import conversation
from tracetap.analysis.packets import SCHEMA_FILE
from tracetap.proxy.apis.registry import readers

GOLDEN = Path(__file__).parent / "golden"


def packets(db: str, out: Path, *flags: str) -> int:
    return cli.main(["packets", "--db", db, "--out", str(out), *flags])


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_packets_equal_the_golden_files_and_are_byte_identical_run_to_run(db_url, tmp_path):
    asyncio.run(seed(db_url))
    flags = ("--max-chars", "60", "--batch", "config.context")
    assert packets(db_url, tmp_path / "one", *flags) == 0
    assert packets(db_url, tmp_path / "two", *flags) == 0
    for name in ("packets.jsonl", "batches.jsonl"):
        written = (tmp_path / "one" / name).read_bytes()
        if os.environ.get("TRACETAP_UPDATE_GOLDEN"):
            (GOLDEN / name).write_bytes(written)
        assert written == (GOLDEN / name).read_bytes(), name
    for name in ("packets.jsonl", "packets.parquet", "batches.jsonl"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    table = pq.read_table(tmp_path / "one" / "packets.parquet").to_pylist()
    assert [json.loads(r["packet"]) for r in table] == lines(tmp_path / "one" / "packets.jsonl")


def test_explicit_episodes_are_read_on_both_backends(db_url, tmp_path, capsys):
    # Ids are bound as one parameter (a JSON array on SQLite, a text array on Postgres).
    asyncio.run(seed(db_url))
    chosen = ("A-t4-0", "A-t1-0", "B-t6-1", "B-t2-0")
    assert packets(db_url, tmp_path, *(f for e in chosen for f in ("--episode", e))) == 0
    out = capsys.readouterr().out
    # A-t4-0's upstream error makes it infra (storage.integrity): not the harness's doing.
    assert "2 failure packets of 4 episodes" in out
    assert "no packet for 1 episodes with integrity infra" in out
    found = lines(tmp_path / "packets.jsonl")
    assert [p["episode_id"] for p in found] == ["B-t2-0", "B-t6-1"]  # task order
    assert [p["calls"] for p in found] == [
        ["B-t2-0-c0", "B-t2-0-c1"],
        ["B-t6-1-c0", "B-t6-1-c1"],
    ]


def test_every_packet_follows_the_documented_json_schema(seeded, tmp_path):
    assert packets(seeded, tmp_path, "--max-chars", "40") == 0
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    found = lines(tmp_path / "packets.jsonl")
    assert found
    for packet in found:
        jsonschema.validate(packet, schema)


def test_failed_episodes_their_reasons_steps_and_links(seeded, tmp_path, capsys):
    assert packets(seeded, tmp_path, "--max-chars", "100") == 0
    assert (
        "11 failure packets of 24 episodes (unsuccessful: 11, call_error: 1, "
        "context_length: 1)" in capsys.readouterr().out
    )
    by_id = {p["episode_id"]: p for p in lines(tmp_path / "packets.jsonl")}
    # The failures of the seed and nothing else: A fails t3 once, t4-t6 twice; B fails
    # t2 twice, t5 once, t6 twice; but A-t4-0, whose upstream failed, is infra.
    assert sorted(by_id) == sorted(
        [
            "A-t3-1",
            "A-t4-1",
            "A-t5-0",
            "A-t5-1",
            "A-t6-0",
            "A-t6-1",
            "B-t2-0",
            "B-t2-1",
            "B-t5-1",
            "B-t6-0",
            "B-t6-1",
        ]
    )
    assert by_id["B-t6-1"]["outcome"]["failure"] == ["unsuccessful", "call_error", "context_length"]
    [error] = by_id["B-t6-1"]["outcome"]["call_errors"]
    assert error == {
        "call_id": "B-t6-1-c1",
        "status": "ok",
        "http_status": 400,
        "error": None,
    }
    packet = by_id["A-t5-0"]
    assert packet["task"] == {
        "system": "You are an agent. Use the search tool.",
        "user": "Solve task t5.",
        "tools": [
            {
                "name": "search",
                "description": "Search the notes.",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            }
        ],
    }
    first, last = packet["steps"]
    assert first["tool_calls"] == [{"name": "search", "arguments": '{"q": "t5"}'}]
    [observation] = first["observations"]
    # 3,500 characters cut to 100 around an explicit marker.
    assert observation["content"] == "note " * 10 + "[... tracetap cut 3400 chars ...]" + (
        "note " * 10
    )
    assert last["text"] == "I do not know" and last["observations"] == []
    assert [first["call_id"], last["call_id"]] == ["A-t5-0-c0", "A-t5-0-c1"]
    assert packet["calls"] == ["A-t5-0-c0", "A-t5-0-c1"]
    assert packet["harness"] == {
        "name": "A",
        "config": {"context": "full", "retries": 0, "prompt": "short"},
    }
    assert packet["outcome"]["rewards"] == {"exact": 0.0} and packet["viewer"].endswith(
        "/episodes/A-t5-0"
    )


def test_failure_kinds_steps_and_where_narrow_the_packets(seeded, tmp_path):
    assert packets(seeded, tmp_path, "--failure", "context_length") == 0
    assert [p["episode_id"] for p in lines(tmp_path / "packets.jsonl")] == ["B-t6-1"]
    assert packets(seeded, tmp_path, "--where", "harness=A,task=t4", "--steps", "1") == 0
    found = lines(tmp_path / "packets.jsonl")
    assert [p["episode_id"] for p in found] == ["A-t4-1"]  # A-t4-0 is infra
    assert [[s["index"] for s in p["steps"]] for p in found] == [[1]]
    assert [p["steps_total"] for p in found] == [2]
    # A lower bar for success: reward 0 is enough, so only call errors remain.
    assert packets(seeded, tmp_path, "--threshold", "0") == 0
    assert [p["outcome"]["failure"] for p in lines(tmp_path / "packets.jsonl")] == [
        ["call_error", "context_length"],
    ]


def test_per_batch_keeps_the_first_failures_of_each_batch(seeded, tmp_path, capsys):
    assert packets(seeded, tmp_path, "--batch", "harness") == 0
    every = lines(tmp_path / "packets.jsonl")
    capsys.readouterr()
    assert packets(seeded, tmp_path, "--batch", "harness", "--per-batch", "2") == 0
    kept = lines(tmp_path / "packets.jsonl")
    by_batch: dict[str, list[str]] = {}
    for p in every:
        by_batch.setdefault(p["batch"], []).append(p["episode_id"])
    assert [p["episode_id"] for p in kept] == [e for ids in by_batch.values() for e in ids[:2]]
    assert len(kept) < len(every) and all(len(ids) >= 2 for ids in by_batch.values())
    batches = lines(tmp_path / "batches.jsonl")
    assert [b["packets"] for b in batches] == [ids[:2] for ids in by_batch.values()]
    assert f"{len(every) - len(kept)} more failed episodes left out" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--per-batch", "0"), "--per-batch must be at least 1"),
        (("--where", "harness=Z"), "the selection matches no episode (--where 'harness=Z')"),
        (("--where", "harnes=A"), "unknown key 'harnes'"),
        (("--where", "harness"), "'harness' is not KEY=VALUE"),
        (("--batch", "policy"), "--batch 'policy' is not one of"),
        (("--steps", "0"), "--steps and --max-chars must be at least 1"),
    ],
)
def test_mistakes_are_one_clear_line_and_write_nothing(seeded, tmp_path, capsys, flags, message):
    assert packets(seeded, tmp_path / "out", *flags) == 1
    err = capsys.readouterr().err
    assert err.startswith("tracetap packets: error: ") and message in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_messages_and_responses_bodies_read_as_steps():
    request = {
        "system": "Be brief.",
        "tools": [{"name": "ls", "input_schema": {}}],
        "messages": [
            {"role": "user", "content": "List it."},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "tu1", "name": "ls", "input": {"path": "/"}}
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "tu1",
                        "content": [{"type": "text", "text": "a b"}],
                    }
                ],
            },
        ],
    }
    response = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "a and b"}],
    }
    task, steps = conversation.read(readers(), "messages:chat", json.dumps(request), None,
                                   json.dumps(response), 50)
    assert (task.system, task.user, task.tools) == (
        "Be brief.",
        "List it.",
        [{"name": "ls", "description": None, "parameters": {}}],
    )
    assert [(s.tool_calls, s.observations, s.text) for s in steps] == [
        (
            [{"name": "ls", "arguments": '{"path":"/"}'}],
            [{"source": "tool", "name": "ls", "content": "a b"}],
            None,
        ),
        ([], [], "a and b"),
    ]
    request = {
        "instructions": "Be brief.",
        "tools": [{"type": "function", "name": "ls"}],
        "input": [
            {"role": "user", "content": "List it."},
            {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "a b"},
        ],
    }
    response = {
        "output": [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "a and b"}],
            }
        ]
    }
    task, steps = conversation.read(readers(), "responses:chat", json.dumps(request), None,
                                   json.dumps(response), 50)
    assert (task.system, task.user) == ("Be brief.", "List it.")
    assert [(s.tool_calls, s.observations, s.text) for s in steps] == [
        (
            [{"name": "ls", "arguments": "{}"}],
            [{"source": "tool", "name": "ls", "content": "a b"}],
            None,
        ),
        ([], [], "a and b"),
    ]


def test_odd_shaped_bodies_are_read_leniently():
    # Off the typed path (a number as content, a non-object message and part, a tool that
    # is not an object): what can be read is, the rest is skipped, nothing raises.
    request = {
        "system": 7,
        "tools": ["ls", {"type": "function", "function": {"name": "ls", "parameters": None}}],
        "messages": [
            "stray",
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}, 3]},
            {"role": "user", "content": "List it."},
            {
                "role": "assistant",
                "content": 42,
                "tool_calls": [{"id": "c1", "function": {"name": "ls", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": {"not": "text"}},
        ],
    }
    reply = {"role": "assistant", "content": ["x", {"type": "text", "text": "done"}]}
    response = {"choices": [{"message": reply}]}
    task, steps = conversation.read(readers(), "chat.completions", json.dumps(request), None,
                                   json.dumps(response), 50)
    assert (task.system, task.user) == ("Be brief.", "List it.")
    assert task.tools == [{"name": "ls", "description": None, "parameters": None}]
    assert [(s.text, s.tool_calls, s.observations) for s in steps] == [
        (
            None,
            [{"name": "ls", "arguments": "{}"}],
            [{"source": "tool", "name": "ls", "content": None}],
        ),
        ("done", [], []),
    ]
