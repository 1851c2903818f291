"""Two proxy replicas on one Postgres: an episode served by both exports as if by one."""

from __future__ import annotations

import openai
import pyarrow.dataset as ds
from helpers.http import finish
from helpers.servers import stored_calls

from tracetap.exporters import export
from tracetap.migrations import upgrade

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"step": {"type": "integer"}}}}}]


def _episode(base_urls: list[str]) -> None:
    """A tool-using agent whose turn i goes to base_urls[i % len(base_urls)]."""
    messages = [{"role": "user", "content": "Find the answer."}]
    for turn in range(6):
        client = openai.OpenAI(base_url=base_urls[turn % len(base_urls)], api_key="x",
                               max_retries=0)
        with client:
            reply = client.chat.completions.create(model="mock-model", messages=messages,
                                                   tools=TOOLS,
                                                   extra_body={"mock_tool_rounds": 3})
        message = reply.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        if reply.choices[0].finish_reason == "tool_calls":
            messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                             "content": "42"})
        else:
            messages.append({"role": "user", "content": "And once more?"})


def test_an_episode_alternating_between_replicas_exports_like_one_proxy(
        engine, fresh_postgres, run_proxy, tmp_path):
    upgrade(fresh_postgres)
    a = run_proxy(engine.url, fresh_postgres, data_dir=tmp_path / "a")
    b = run_proxy(engine.url, fresh_postgres, data_dir=tmp_path / "b")
    _episode([a.episode_url("split"), b.episode_url("split")])
    _episode([a.episode_url("single")])
    finish(a, "split")
    finish(b, "single")
    a.stop()
    b.stop()  # SIGTERM: both flush everything they captured

    export(fresh_postgres, tmp_path / "out")
    table = ds.dataset(tmp_path / "out" / "trajectories", format="parquet").to_table()
    rows = {r["episode_id"]: r for r in table.to_pylist()}
    columns = ("prompt_ids", "response_ids", "response_mask", "response_logprobs", "num_turns")
    split, single = rows["split"], rows["single"]
    assert len(table) == 2
    assert split["num_turns"] == 6
    assert sum(split["response_mask"]) > 0
    for column in columns:
        assert split[column] == single[column], column
    stored = stored_calls(fresh_postgres, "split")
    assert len(stored) == 6 and len({c["instance"] for c in stored}) == 2
