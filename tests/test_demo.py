"""``tracetap demo`` and ``tracetap mock-engine`` as a user runs them: real subprocesses."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import openai
import pyarrow.parquet as pq
import pytest
from helpers.http import wait_ready
from helpers.loop import free_port
from helpers.servers import stored_calls

from tracetap.demo import tokenizer as tok

CLI = [sys.executable, "-m", "tracetap"]
DEMO_TIMEOUT_S = 120


def run_demo(*flags: str) -> subprocess.CompletedProcess:
    done = subprocess.run([*CLI, "demo", *flags], capture_output=True, text=True,
                          timeout=DEMO_TIMEOUT_S)
    assert done.returncode == 0, f"demo failed:\n{done.stdout}\n{done.stderr}"
    return done


class Demo:
    def __init__(self, data_dir: Path, stdout: str):
        self.data_dir, self.stdout = data_dir, stdout
        self.db = f"sqlite:///{data_dir / 'tracetap.db'}"
        self.calls = pq.read_table(data_dir / "export" / "calls").to_pylist()
        self.trajectories = pq.read_table(data_dir / "export" / "trajectories").to_pylist()

    def variant(self, row: dict) -> str:
        return json.loads(row["harness_config"])["variant"]

    def rows(self, variant: str) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for row in self.trajectories:
            if self.variant(row) == variant:
                out.setdefault(row["episode_id"], []).append(row)
        return out


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Demo:
    data_dir = tmp_path_factory.mktemp("demo")
    return Demo(data_dir, run_demo("--data-dir", str(data_dir)).stdout)


def test_demo_exports_every_episode_and_prints_the_table(demo):
    assert len({r["episode_id"] for r in demo.calls}) == 10
    assert len({r["episode_id"] for r in demo.trajectories}) == 10
    assert len(demo.trajectories) == 11  # 3 + 2 (the rewrite splits) + 4 + 2 other APIs
    # tool rounds 2, 3, 4; 5 around the rewrite; 4 x 3; Responses and Messages 3 each
    assert len(demo.calls) == 35
    assert {r["status"] for r in demo.calls} == {"ok"}
    assert all(r["reward"] is not None and r["outcome"] for r in demo.trajectories)
    for line in ("episodes       10", "calls          35", "trajectories   11"):
        assert line in demo.stdout
    assert str(demo.data_dir / "export" / "trajectories") in demo.stdout
    assert demo.stdout.count("calls captured") == 10


def test_the_printed_pyarrow_snippet_loads_the_trajectories(demo):
    lines = demo.stdout.split("load them with pyarrow:\n", 1)[1].splitlines()[:3]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec("\n".join(line.strip() for line in lines), {})  # the user's three lines
    assert printed.getvalue().strip()


def test_append_only_episodes_are_exactly_the_engines_token_sequences(demo):
    episodes = demo.rows("append-only")
    assert len(episodes) == 3
    for episode_id, [row] in episodes.items():
        calls = stored_calls(demo.db, episode_id)
        assert row["split_reason"] is None and row["num_turns"] == len(calls) >= 3
        assert row["call_ids"] == [c["call_id"] for c in calls]
        last = calls[-1]
        completion = last["choices"][0]["completion_ids"]
        sequence = row["prompt_ids"] + row["response_ids"]
        assert sequence == last["prompt_ids"] + completion
        # Independently: re-render the whole conversation with the engine's chat template.
        request = json.loads(last["request"])
        answer = json.loads(last["response"])["choices"][0]["message"]
        conversation = [*request["messages"], {"role": "assistant", "content": answer["content"]}]
        rendered = tok.apply_chat_template(conversation, request["tools"],
                                           add_generation_prompt=False)
        assert sequence == rendered[:-1]  # the completion ends at <|im_end|>, before its "\n"
        assert row["prompt_ids"] == calls[0]["prompt_ids"]
        sampled = sum(len(c["choices"][0]["completion_ids"]) for c in calls)
        assert sum(row["response_mask"]) == sampled
        assert len(row["response_logprobs"]) == len(row["response_ids"])


def test_the_context_rewrite_splits_into_a_non_prefix_root(demo):
    [rows] = demo.rows("context-rewrite").values()
    assert [r["split_reason"] for r in rows] == [None, "non_prefix"]
    assert [r["num_turns"] for r in rows] == [2, 3]


# The Responses agent offers tools, so under --translate auto on vLLM its calls go to the
# engine as chat: native Responses has nowhere to put a tool-call-only turn's logprobs.
@pytest.mark.parametrize(("variant", "endpoint"), [("responses-api", "responses:chat"),
                                                   ("messages-api", "messages:chat")])
def test_responses_and_messages_agents_export_as_one_exact_trajectory(demo, variant, endpoint):
    [[row]] = demo.rows(variant).values()
    calls = stored_calls(demo.db, row["episode_id"])
    assert {c["endpoint"] for c in calls} == {endpoint}
    assert row["split_reason"] is None and row["num_turns"] == len(calls) == 3
    last = calls[-1]
    assert row["prompt_ids"] + row["response_ids"] == (
        last["prompt_ids"] + last["choices"][0]["completion_ids"])
    sampled = sum(len(c["choices"][0]["completion_ids"]) for c in calls)
    assert sum(row["response_mask"]) == sampled
    # Through chat: a logprob for every token, the tool-call-only turns' included.
    assert len(row["response_logprobs"]) == len(row["response_ids"])


def test_the_group_is_four_samples_of_one_task_that_differ(demo):
    group = demo.rows("group")
    assert len(group) == 4
    rows = [row for [row] in group.values()]
    assert len({(r["group_id"], r["task_id"]) for r in rows}) == 1
    assert len({tuple(r["prompt_ids"]) for r in rows}) == 1  # the same task prompt...
    assert len({tuple(r["response_ids"]) for r in rows}) == 4  # ...sampled four ways


def test_clean_removes_only_what_the_demo_wrote(tmp_path):
    mine = tmp_path / "notes.txt"
    mine.write_text("keep me")
    done = run_demo("--data-dir", str(tmp_path), "--episodes", "0", "--clean", "--quiet")
    assert "episodes       7" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# ---- tracetap mock-engine ------------------------------------------------------------------

@pytest.fixture(scope="module")
def mock_engine(tmp_path_factory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with log.open("wb") as out, subprocess.Popen(
        [*CLI, "mock-engine", "--port", str(port)], stdout=out, stderr=subprocess.STDOUT
    ) as process:
        url = f"http://127.0.0.1:{port}"
        try:
            try:
                wait_ready(url + "/health", process, what="mock-engine")
            except AssertionError as error:
                raise AssertionError(f"{error}:\n{log.read_text()}") from None
            yield url + "/v1"
        finally:
            process.terminate()
            process.wait(10)


@pytest.fixture
def client(mock_engine) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=mock_engine, api_key="unused", max_retries=0,
                       timeout=10) as c:
        yield c


MESSAGES = [{"role": "user", "content": "Say something."}]
IDS = {"return_token_ids": True}


def test_mock_engine_answers_chat_with_and_without_streaming(client):
    reply = client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                           logprobs=True, extra_body=IDS)
    [choice] = reply.choices
    assert choice.finish_reason == "stop" and choice.message.content
    assert reply.model_extra["prompt_token_ids"] == tok.apply_chat_template(MESSAGES)
    ids = choice.model_extra["token_ids"]
    assert tok.decode(ids) == choice.message.content + "<|im_end|>"
    assert len(choice.logprobs.content) == len(ids)

    stream = client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                            stream=True, extra_body=IDS)
    with stream:
        chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # deterministic: the same tokens either way
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra.get(
        "token_ids") or ()] == ids


def test_mock_engine_answers_a_tool_call(client):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    reply = client.chat.completions.create(model="mock-model", messages=MESSAGES, tools=tools)
    [call] = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls"
    # Arguments follow the tool's schema: one without properties gets an empty object.
    assert call.function.name == "lookup" and json.loads(call.function.arguments) == {}


def test_mock_engine_answers_completions_with_and_without_streaming(client):
    reply = client.completions.create(model="mock-model", prompt="Once upon a time",
                                      logprobs=2, extra_body=IDS)
    [choice] = reply.choices
    assert choice.text and choice.finish_reason == "stop"
    assert choice.model_extra["prompt_token_ids"] == tok.encode("Once upon a time")
    assert len(choice.logprobs.tokens) == len(choice.model_extra["token_ids"])

    stream = client.completions.create(model="mock-model", prompt="Once upon a time",
                                       stream=True)
    with stream:
        text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text == choice.text
    counts = Counter(m.id for m in client.models.list().data)
    assert counts == {"mock-model": 1}


def test_two_harness_variants_feed_packets_compare_and_harnesses(tmp_path, capsys):
    from tracetap import cli

    data_dir = tmp_path / "variants"
    out = run_demo("--data-dir", str(data_dir), "--episodes", "0", "--variants",
                   "--quiet").stdout
    assert "tracetap compare --data-dir" in out  # the printed loop
    demo = Demo(data_dir, out)
    factors = {}
    for row in demo.trajectories:
        found = {f["factor"]: f["level"] for f in row["harness_factors"]}
        if "context" in found:
            factors.setdefault(row["episode_id"], []).append(found["context"])
    assert len(factors) == 16
    # The factor changes the agent: a summarised context splits its episode in two rows.
    assert {e: len(c) for e, c in factors.items() if c[0] == "full"} == dict.fromkeys(
        [e for e, c in factors.items() if c[0] == "full"], 1)
    assert all(len(c) == 2 for c in factors.values() if c[0] == "summarised")
    common = ["--data-dir", str(data_dir), "--success-outcome", "solved"]
    assert cli.main(["compare", *common, "--json", "--baseline", "config.context=full",
                     "--candidate", "config.context=summarised"]) == 0
    result = json.loads(capsys.readouterr().out)
    [candidate] = result["candidates"]
    assert candidate["paired_tasks"] == 4 and result["baseline"]["episodes"] == 8
    assert candidate["tokens_delta"] != 0  # the summarised agent resends other prompts
    assert cli.main(["packets", *common, "--out", str(tmp_path / "packets"),
                     "--where", "meta.batch=variants", "--batch", "config.context"]) == 0
    assert "failure packets of 16 episodes" in capsys.readouterr().out
    packets = [json.loads(line) for line in
               (tmp_path / "packets" / "packets.jsonl").read_text().splitlines()]
    assert packets and all(p["batch"] == p["harness"]["config"]["context"] for p in packets)
    assert all(p["outcome"]["outcome"] != "solved" for p in packets)
    assert cli.main(["harnesses", *common, "--json", "--where", "meta.batch=variants",
                     "--factor", "context", "--factor", "seed"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["episodes"] == 16 and report["unseen_pairs"] == []
