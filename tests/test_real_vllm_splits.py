"""Every split on a real engine says why: replies recorded once from a real vLLM 0.32 (CPU
build, Gemma 3 270M; tests/fixtures/real_vllm/record.py), replayed to the proxy in the order
they came, with the same openai SDK episodes as the recording.

- a chat turn that ends on a ``stop`` string: vLLM keeps the stop token in ``token_ids``
  and cuts its text, so the harness's next request, which resends the text, leaves that
  turn's context one token early and branches from the turn before it: ``branch``, cause
  ``stop_string_cut``, at the stop token;
- a Responses episode whose replies end in a newline that Gemma's template trims from a
  resent turn: ``non_prefix``, cause ``template_drift`` (the harness resent everything as
  it was), not ``unknown``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import openai
import pyarrow.parquet as pq
import pytest
from aiohttp import web
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.exporters import export
from tracetap.exporters.drift import chat_messages, reply_message
from tracetap.exporters.history import CAUSES, history_cause
from tracetap.proxy.runtime.settings import Settings

HERE = Path(__file__).parent / "fixtures" / "real_vllm"
RECORDED = json.loads((HERE / "vllm-0.32-gemma3-270m.json").read_text())
_spec = importlib.util.spec_from_file_location("record_real_vllm", HERE / "record.py")
record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record)
STOP_TOKEN = 236761  # Gemma's "."


def replay_app(sent: list[dict]) -> web.Application:
    """The recorded engine: each POST answered by the next recorded reply for its path,
    once its conversation is checked to be the recorded one; each GET by its answer."""
    posts = [e for e in RECORDED if e["method"] == "POST"]
    gets = {e["path"]: e for e in RECORDED if e["method"] == "GET"}

    async def handle(request: web.Request) -> web.Response:
        if request.method == "GET":
            recorded = gets.get(request.path_qs)
            if recorded is None:
                return web.Response(status=404)
        else:
            body = await request.json()
            sent.append(body)
            recorded = next(e for e in posts if e["path"] == request.path_qs)
            posts.remove(recorded)
            key = "messages" if "messages" in body else "input"
            assert body[key] == recorded["request"][key], "the replay left the recording"
        return web.Response(text=recorded["response"], status=recorded["status"],
                            headers={"Content-Type": recorded["content_type"]})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


@pytest.fixture
def rows(loop_thread, serve_app, migrated_sqlite, tmp_path) -> list[dict]:
    sent: list[dict] = []
    upstream = serve_app(replay_app(sent))
    db = migrated_sqlite(tmp_path / "t.db")
    settings = Settings(upstream=upstream + "/v1", db=db, data_dir=str(tmp_path / "data"),
                        port=free_port(), upstream_flavor="vllm")
    proxy = Proxy(loop_thread, settings).start()
    try:
        for name, run in (("stop", record.chat_stop_episode),
                          ("resp-stream", record.responses_streamed_episode)):
            with openai.OpenAI(base_url=proxy.episode_url(name), api_key="x",
                               max_retries=0) as client:
                run(client)
        assert len(sent) == sum(e["method"] == "POST" for e in RECORDED)
        proxy.flush()
    finally:
        proxy.stop()
    export(db, tmp_path / "out", finished_only=False)
    return pq.read_table(tmp_path / "out" / "trajectories").to_pylist()


def test_a_turn_cut_at_a_stop_string_branches_with_its_cause(rows):
    mine = [r for r in rows if r["episode_id"] == "stop"]
    assert [r["split_reason"] for r in mine] == [None, "branch"]
    main, branch = mine
    assert branch["drift_cause"] == "stop_string_cut"
    # Where: the stop token the turn sampled, where the resent prompt closes the turn.
    assert branch["drift_expected_token"] == STOP_TOKEN
    assert branch["drift_call_id"] == main["call_ids"][-1]
    assert branch["drift_message_index"] == 4  # the turns agree: the next message differs


def test_a_responses_episode_splits_with_a_cause_worked_out_from_its_input(rows):
    mine = [r for r in rows if r["episode_id"] == "resp-stream"]
    assert [r["split_reason"] for r in mine] == [None, "non_prefix", "non_prefix"]
    for row in mine[1:]:
        assert row["drift_cause"] == "template_drift"
        assert (row["drift_expected_token"], row["drift_received_token"]) == (107, 106)


def test_every_drift_cause_is_explained_in_fidelity_md():
    table = (Path(__file__).parents[1] / "docs" / "fidelity.md").read_text()
    documented = {line.split("`")[1] for line in table.splitlines()
                  if line.startswith("| `") and line.count("|") == 4}
    assert set(CAUSES) <= documented, set(CAUSES) - documented


def test_responses_input_reads_as_the_chat_messages_a_reply_is_compared_with():
    request = {"instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Look it up."}]},
        {"type": "reasoning", "summary": []},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"q":1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "found"}]}
    reply = reply_message({"object": "response", "output": [
        {"type": "message", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "c1", "name": "lookup",
         "arguments": '{"q":1}'}]}, 0)
    messages = chat_messages(request)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[2] == reply  # the resent turn is the reply: no split cause in it
    assert history_cause([*messages[:2], reply], messages, 2) == ("template_drift", 3)
