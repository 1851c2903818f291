"""Policy version per token: a weight sync during a call is recorded as spans,
tokens of the sync window as unknown, exported with ``mixed_policy``, masked on request."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from itertools import pairwise

import openai
import pyarrow.parquet as pq
import pytest

from tracetap.exporters import export
from tracetap.exporters.adapters import to_slime, to_verl
from tracetap.migrations import upgrade

MESSAGES = [{"role": "user", "content": "count for me"}]


@pytest.fixture
def db_url(tmp_path):
    url = f"sqlite:///{tmp_path / 'tracetap.db'}"  # one database kind: the logic is the proxy's
    upgrade(url)
    return url


def _spans(proxy, episode: str) -> list:
    proxy.flush()
    path = proxy.settings.db.removeprefix("sqlite:///")
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT c.seq, ch.policy_spans FROM calls c JOIN choices ch "
                          "ON ch.call_id = c.call_id WHERE c.episode_id = ? ORDER BY c.seq",
                          (episode,)).fetchall()
    return [None if spans is None else json.loads(spans) for _, spans in rows]


def _stream_across_a_sync(proxy, episode: str) -> str:
    """A streamed call during which the proxy pauses and resumes on a new version."""
    client = openai.OpenAI(base_url=proxy.episode_url(episode), api_key="x", max_retries=0)
    text = []
    with client:
        stream = client.chat.completions.create(
            model="mock-model", messages=MESSAGES, max_tokens=60, stream=True,
            extra_body={"mock_completion_tokens": 36, "mock_chunk_delay_s": 0.04})
        for i, chunk in enumerate(stream):
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
            if i == 10:
                assert proxy.admin("POST", "/tracetap/pause", {"wait": False})[0] == 200
            if i == 20:
                assert proxy.admin("POST", "/tracetap/resume", {"policy_version": "v2"})[0] == 200
    return "".join(text)


def test_a_stream_across_a_weight_sync_stores_spans_with_the_sync_window_unknown(proxy):
    assert proxy.admin("PUT", "/tracetap/policy", {"version": "v1"})[0] == 200
    text = _stream_across_a_sync(proxy, "sync-stream")
    assert text  # the agent got its answer whole
    [spans] = _spans(proxy, "sync-stream")
    assert [v for _, v in spans] == ["v1", None, "v2"]
    starts = [s for s, _ in spans]
    assert starts[0] == 0 and starts == sorted(starts) and starts[1] >= 5  # ~10 before the pause
    assert proxy.calls("sync-stream")[0]["policy_version"] == "v1"  # stamped at admission


def test_a_whole_body_across_a_sync_is_unknown_and_an_untouched_call_stores_no_spans(proxy):
    assert proxy.admin("PUT", "/tracetap/policy", {"version": "v1"})[0] == 200
    client = openai.OpenAI(base_url=proxy.episode_url("sync-body"), api_key="x", max_retries=0)
    with client:
        client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=8)
        started = threading.Event()

        def slow_call():
            started.set()
            client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=8,
                                           extra_body={"mock_delay_s": 1.5})

        worker = threading.Thread(target=slow_call)
        worker.start()
        started.wait()
        _wait_inflight(proxy)
        assert proxy.admin("POST", "/tracetap/pause", {"wait": False})[0] == 200
        assert proxy.admin("POST", "/tracetap/resume", {"policy_version": "v2"})[0] == 200
        worker.join(30)
    # The body came whole after the sync: which tokens came before it is not known.
    assert _spans(proxy, "sync-body") == [None, [[0, None]]]


def _wait_inflight(proxy) -> None:
    deadline = time.monotonic() + 10
    while proxy.state.gate.inflight == 0:
        assert time.monotonic() < deadline, "the call never reached the gate"
        time.sleep(0.01)  # polling the proxy's own counter for the call to be admitted


def test_the_export_carries_runs_and_mixed_policy_and_adapters_mask_on_request(proxy, tmp_path):
    assert proxy.admin("PUT", "/tracetap/policy", {"version": "v1"})[0] == 200
    _stream_across_a_sync(proxy, "sync-export")
    assert proxy.admin("POST", "/tracetap/episodes/sync-export/finish", {"reward": 1.0})[0] == 200
    proxy.flush()
    export(proxy.settings.db, tmp_path / "out")
    calls = pq.read_table(tmp_path / "out" / "calls").to_pylist()
    [call] = calls
    runs = call["policy_spans"]
    assert [r["version"] for r in runs] == ["v1", None, "v2"]
    assert runs[0]["start"] == 0 and runs[-1]["end"] == len(call["completion_ids"])
    assert all(a["end"] == b["start"] for a, b in pairwise(runs))
    assert call["mixed_policy"] is True
    [row] = pq.read_table(tmp_path / "out" / "trajectories").to_pylist()
    assert row["mixed_policy"] is True
    assert row["response_policy_spans"] == runs  # one turn: the response is the completion
    trained = sum(row["response_mask"])
    unknown = runs[1]["end"] - runs[1]["start"]
    assert sum(to_verl(row)["response_mask"]) == trained  # keep: as before
    assert sum(to_verl(row, policy="known")["response_mask"]) == trained - unknown
    v2 = runs[2]["end"] - runs[2]["start"]
    assert sum(to_slime(row, policy="latest")["loss_mask"]) == v2
    assert sum(to_slime(row, policy="v1")["loss_mask"]) == runs[0]["end"]
    # The sequence stays whole: masked tokens are context, never dropped.
    assert len(to_verl(row, policy="v2")["response_ids"]) == len(row["response_ids"])


def test_rows_without_spans_read_as_one_run_of_the_stamped_version(proxy, tmp_path):
    assert proxy.admin("PUT", "/tracetap/policy", {"version": "v7"})[0] == 200
    client = openai.OpenAI(base_url=proxy.episode_url("plain"), api_key="x", max_retries=0)
    with client:
        client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=8)
    assert _spans(proxy, "plain") == [None]  # nothing changed: nothing extra stored
    assert proxy.admin("POST", "/tracetap/episodes/plain/finish", {"reward": 0.0})[0] == 200
    proxy.flush()
    export(proxy.settings.db, tmp_path / "out")
    [call] = pq.read_table(tmp_path / "out" / "calls").to_pylist()
    assert call["policy_spans"] == [{"start": 0, "end": len(call["completion_ids"]),
                                     "version": "v7"}]
    assert call["mixed_policy"] is False


def test_a_call_whose_every_token_is_of_an_unknown_version_is_mixed():
    """All tokens of the sync window (one span, version null), or a call stamped with no
    version at all: nothing says which weights sampled them, so ``mixed_policy`` is set
    in both datasets (one version, but not a known one)."""
    from types import SimpleNamespace

    from tracetap.exporters.policy import call_spans, trajectory_runs

    ids = bytes(4 * 3)  # three completion ids, as storage packs them
    columns = {"choice_index": [0, 0, 0], "policy_spans": [[[0, None]], None, None],
               "policy_version": ["v1", None, "v1"], "completion_ids": [ids, ids, ids]}
    out = call_spans(columns)
    assert out["mixed_policy"] == [True, True, False]
    assert out["policy_spans"][0] == [{"start": 0, "end": 3, "version": None}]
    call = SimpleNamespace(policy_version="v1")
    unknown = SimpleNamespace(policy_spans=[[0, None]])
    assert trajectory_runs([(call, unknown, 5, 3, True)]) == (
        [{"start": 5, "end": 8, "version": None}], True)
    known = SimpleNamespace(policy_spans=None)
    assert trajectory_runs([(call, known, 5, 3, True)])[1] is False
