"""A synthetic database with a known answer for the analysis commands, through storage.

Two harness variants run six tasks twice each. Per task, the share of successful
repeats is SUCCESS[harness][task]; harness A costs 110 tokens and 1 s per call, B 170
tokens and 2 s. Factors: context and retries follow the harness (so two of their level
pairs never run), prompt follows the repeat. A-t4-0 has an upstream error, B-t6-1 a
context-length 400; B's second repeats carry the overlay "o1" in their metadata.

Also a pytest plugin (loaded by tests/conftest.py): the fixture ``seeded`` is the seed in
a SQLite database of its own, one per test module.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tracetap import cli
from tracetap.migrations import upgrade
from tracetap.storage import queries
from tracetap.storage.engine import create_engine
from tracetap.storage.records import CallRecord, ChoiceRecord
from tracetap.storage.rows import insert_calls

TASKS = ("t1", "t2", "t3", "t4", "t5", "t6")
SUCCESS = {
    "A": {"t1": 1.0, "t2": 1.0, "t3": 0.5, "t4": 0.0, "t5": 0.0, "t6": 0.0},
    "B": {"t1": 1.0, "t2": 0.0, "t3": 1.0, "t4": 1.0, "t5": 0.5, "t6": 0.0},
}
CONFIG = {"A": {"context": "full", "retries": 0}, "B": {"context": "window", "retries": 3}}
PROMPTS = ("short", "long")
TOKENS = {"A": (100, 10), "B": (150, 20)}  # per call: prompt, completion
SECONDS = {"A": 1.0, "B": 2.0}  # per call
SYSTEM = "You are an agent. Use the search tool."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


def succeeded(harness: str, task: str, repeat: int) -> bool:
    # 0.5: the first repeat succeeds, the second fails.
    return SUCCESS[harness][task] == 1.0 or (SUCCESS[harness][task] == 0.5 and repeat == 0)


def episode_id(harness: str, task: str, repeat: int) -> str:
    return f"{harness}-{task}-{repeat}"


def _records(harness: str, task: str, repeat: int) -> list[CallRecord]:
    eid = episode_id(harness, task, repeat)
    prompt, completion = TOKENS[harness]
    start = 1_700_000_000.0 + 100 * TASKS.index(task) + 10 * repeat
    observation = ("note " * 700) if task == "t5" else f"the notes on {task} say 42"
    user = {"role": "user", "content": f"Solve task {task}."}
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "search", "arguments": json.dumps({"q": task})},
    }
    first = {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, user],
        "tools": TOOLS,
    }
    second = {
        **first,
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": observation},
        ],
    }
    answer = "42" if succeeded(harness, task, repeat) else "I do not know"
    replies = [
        {
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls",
                    "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": answer},
                }
            ]
        },
    ]
    failures = [("ok", 200, None), ("ok", 200, None)]
    if eid == "A-t4-0":
        failures[1] = ("upstream_error", 502, "upstream answered 502 Bad Gateway")
        replies[1] = None
    if eid == "B-t6-1":
        failures[1] = ("ok", 400, None)
        replies[1] = {
            "error": {
                "message": "This model's maximum context length is 4096 tokens",
                "type": "invalid_request_error",
            }
        }
    records = []
    for seq, (request, reply, (status, http, error)) in enumerate(
        zip((first, second), replies, failures)
    ):
        t = start + seq * 3
        records.append(
            CallRecord(
                call_id=f"{eid}-c{seq}",
                episode_id=eid,
                seq=seq,
                instance="seed",
                endpoint="chat.completions",
                model="m",
                policy_version=f"v{repeat}",
                request=json.dumps(request),
                response=None if reply is None else json.dumps(reply),
                status=status,
                http_status=http,
                error=error,
                t_start=t,
                t_first_byte=t + 0.1,
                t_end=t + SECONDS[harness],
                prompt_tokens=prompt,
                completion_tokens=completion,
                choices=[ChoiceRecord(index=0, finish_reason="stop", text=answer)]
                if reply is not None and http == 200
                else [],
            )
        )
    return records


async def seed(url: str) -> None:
    engine = create_engine(url)
    try:
        for harness in ("A", "B"):
            for task in TASKS:
                for repeat in (0, 1):
                    eid = episode_id(harness, task, repeat)
                    await queries.create_episode(
                        engine,
                        episode_id=eid,
                        key_hash=f"{eid:0>64}"[-64:],
                        group_id=None,
                        task_id=task,
                        harness_name=harness,
                        harness_config={**CONFIG[harness], "prompt": PROMPTS[repeat]},
                        metadata={"overlay": "o1"} if harness == "B" and repeat else {},
                    )
                    await insert_calls(engine, _records(harness, task, repeat))
                    ok = succeeded(harness, task, repeat)
                    await queries.finish_episode(
                        engine,
                        eid,
                        reward=1.0 if ok else 0.0,
                        rewards={"exact": float(ok)},
                        outcome="success" if ok else "failure",
                        info={"repeat": repeat},
                    )
    finally:
        await engine.dispose()


def seeded_sqlite(directory: Path) -> str:
    """The seed in a new SQLite database in ``directory`` (for module-scoped fixtures)."""
    url = f"sqlite:///{directory / 'tracetap.db'}"
    upgrade(url)
    asyncio.run(seed(url))
    return url


@pytest.fixture(scope="module")
def seeded(tmp_path_factory) -> str:
    return seeded_sqlite(tmp_path_factory.mktemp("seeded"))


def cli_json(capsys, *argv: str) -> dict:
    """``tracetap ARGV --json``, which must succeed, and what it printed."""
    assert cli.main([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)
