"""The benchmarks stay runnable: each runs briefly and its correctness checks hold.

Nothing here asserts a speed (a noisy machine would make that flaky); the figures are
for people to read. What is asserted is what must be true at any speed: replies through
the proxy are byte-identical to direct ones, every record sent is written, the export
writes exactly the tokens the synthetic database holds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def run(script: str, *args: str, timeout: float = 240) -> str:
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_proxy_bench_relays_byte_identical_replies_and_writes_every_record(postgres):
    out = run("proxy_bench.py", "--rounds", "1", "--seconds", "0.5", "--requests", "25",
              "--idle-seconds", "0.5")
    for variant in ("tracetap-pg", "tracetap-sqlite"):
        summary = re.search(
            rf"^{variant}: .*\n  records sent (\d+), written (\d+), "
            rf"dropped (\d+); .*replies byte-identical to direct: (\w+)$",
            out,
            re.MULTILINE,
        )
        assert summary, out
        sent, written, dropped, identical = summary.groups()
        assert int(sent) > 0 and written == sent and dropped == "0" and identical == "True"
        assert re.search(rf"\[PASS\] {variant} +zero errors", out), out
    assert re.search(r"^ +relay +\d+", out, re.MULTILINE), out
    # The non-streamed and idle rows beside the relay's, for each variant.
    for row in ("non-streamed c=1, added p50 ms", "non-streamed calls/s, c=32",
                r"idle CPU ms per s \(1 = 0\.1% of a core\)"):
        for variant in ("tracetap-pg", "tracetap-sqlite"):
            assert re.search(rf"^{row} +{variant} +[-+\d.]+ +[-+\d.]+ ", out, re.M), (row, out)


def test_export_bench_writes_exactly_the_tokens_it_built(tmp_path):
    episodes, turns, completion, observation, prompt = 30, 3, 16, 4, 8
    out = run(
        "export_bench.py",
        "--episodes",
        str(episodes),
        "--turns",
        str(turns),
        "--completion-tokens",
        str(completion),
        "--observation-tokens",
        str(observation),
        "--prompt-tokens",
        str(prompt),
        "--rounds",
        "2",
        "--workdir",
        str(tmp_path),
    )
    result = json.loads(out[out.index("{") :])
    step = completion + observation
    prompts = [prompt + turn * step for turn in range(turns)]
    per_episode = sum(p + completion for p in prompts) + prompts[-1] + completion
    assert result["episodes"] == episodes and result["trajectories"] == episodes
    assert result["call_rows"] == episodes * turns
    assert result["token_ids_written"] == episodes * per_episode
    assert len(result["ratio_pyarrow_only_over_export_each"]) == 2
    assert result["peak_rss_mib_max"] > 0


def test_capture_cost_prints_every_step(postgres):
    _assert_steps(
        run("capture_cost.py", "--repeat", "20", "--batches", "1"),
        "uuid7 call id",
        "reply: parse + capture + strip",
        "journal: encode + write(2)",
        "database: insert (Postgres)",
        "database: insert (SQLite)",
        "total, storing in Postgres",
    )


def test_analysis_bench_checks_its_answers(tmp_path):
    out = run("analysis_bench.py", "--episodes", "600", "--rounds", "1",
              "--workdir", str(tmp_path))
    for check in ("one packet per failed episode", "Δ_B equals the built difference",
                  "every factor level counted"):
        assert f"[PASS] {check}" in out, out
    assert re.search(r"^  packets +\d+\.\d+ ", out, re.MULTILINE), out


def test_export_s3_bench_writes_the_same_rows_to_s3_as_to_disk(tmp_path):
    out = run("export_s3_bench.py", "--episodes", "40", "--turns", "2", "--rounds", "1",
              "--workdir", str(tmp_path))
    figures = json.loads(out[out.index("{"):])
    assert figures["episodes"] == 40 and figures["same_rows_everywhere"] is True
    assert figures["prune_dry_run_episodes"] == 40


def test_overlay_cost_prints_each_variant():
    out = run("overlay_cost.py", "--calls", "2", "--chunk-delay-ms", "0.5", timeout=60)
    rows = re.findall(r"^(plain|after_model, .*?)\s+(\d+\.\d)\s+(\d+\.\d)\s+(\d+\.\d\d)\s+"
                      r"(\d+\.\d\d)$", out, re.MULTILINE)
    assert [r[0] for r in rows] == ["plain", "after_model, whole reply",
                                    "after_model, tool calls only"], out
    assert rows[0][3:] == ("1.00", "1.00")  # the ratios are to the plain stream


def test_stream_steps_prints_every_step():
    _assert_steps(
        run("stream_steps.py", "--rounds", "1", "--repeat", "1"),
        "SSE parse (65 reads)",
        "capture (65 events)",
        "strip (65 events)",
        "relay path: ModelCall, Relay.chunk per read",
        "body: strip",
    )


_SMALL_AGENTIC = ("--sessions", "1", "--turns", "3", "--tool", "50", "--out", "20",
                  "--system", "30")


def test_storage_bytes_splits_the_writers_cpu_by_step_on_both_databases(postgres):
    lines = [json.loads(line) for line in run(
        "storage_bytes.py", "--writer-steps", *_SMALL_AGENTIC, "--rounds", "1").splitlines()]
    assert [line["db"] for line in lines] == ["sqlite", "postgres"]
    for line in lines:
        [steps] = line["cpu_ms_per_batch"].values()  # one context bucket at this size
        assert set(steps) == {"all", "plan", "index", "rest"}
        assert steps["plan"] > 0 and steps["index"] > 0  # both steps were really timed


def test_storage_bytes_prints_the_search_index_beside_its_floor(postgres):
    floor = json.loads(run("storage_bytes.py", "--db", "postgres", "--index-floor",
                           *_SMALL_AGENTIC).splitlines()[-1])
    assert floor["calls"] == 3 and floor["pairs"] >= floor["distinct_words"] > 0
    # An exact index of the words cannot hold less than their information content.
    assert 0 < floor["floor_bytes_per_unique_token"] \
        < floor["index_bytes_per_unique_token_written"]["total"]


def test_data_floor_compresses_what_every_turn_must_keep():
    floor = json.loads(run("data_floor.py", *_SMALL_AGENTIC).splitlines()[-1])
    parts = floor["xz_bytes_per_unique_token"]
    # Random ids carry ~17 bits each, and their text the same digits again.
    assert 2.0 < parts["ids"] < 4.0 and 2.0 < parts["text"] < 7.31
    assert parts["logprobs"] > 0
    assert parts["all"] <= parts["text"] + parts["ids"] + parts["logprobs"]


def test_agentic_steps_prints_every_step_and_its_profile():
    out = run("agentic_steps.py", "--turns", "1", "--rounds", "1", "--tool", "40",
              "--out", "12", "--system", "20", "--profile")
    assert "other events" in out and "context " in out
    assert "relay.py" in out and "(chunk)" in out  # cProfile's table: the relay's reads


def _assert_steps(out: str, *steps: str) -> None:
    """Each step is printed with a positive CPU figure."""
    rows = dict(re.findall(r"^(\S.*?)\s{2,}(\d+\.\d)\b", out, re.MULTILINE))
    assert set(steps) <= set(rows), out
    assert all(float(v) > 0 for v in rows.values()), out


def test_agentic_bench_keeps_every_call_and_relays_what_direct_gets(postgres, tmp_path):
    # A 700-token system prompt: the first chunk's ids are past prompt_cut's threshold,
    # so the cut and the per-episode prefix decoding are what the read-back checks.
    figures = tmp_path / "agentic.json"
    out = run("agentic.py", "--sessions", "2", "--turns", "3", "--tool", "40", "--out", "12",
              "--system", "700", "--rounds", "1", "--idle-seconds", "0.5",
              "--json", str(figures))
    result = json.loads(figures.read_text())
    assert result["checks_pass"], out
    for arm in ("sqlite", "pg"):
        summary = re.search(
            rf"^{arm}: calls made (\d+), in the database (\d+) with status ok; "
            rf"completion ids (\d+)/(\d+); replies byte-identical to direct: (\d+)/(\d+); "
            rf"the lone session's ids read back exact: True$",
            out, re.MULTILINE)
        assert summary, out
        made, kept, ids, expected_ids, same, compared = map(int, summary.groups())
        # 2 warm-up turns, one session alone and 2 at once, 3 turns each.
        assert made == kept == 2 + 3 * 3 and ids == expected_ids == made * 12
        assert same == compared == 3 * 3
        assert result["arms"][arm]["stored_ids_per_unique_token"] > 0
        assert set(result["arms"][arm]["cpu_ms_alone"]) == {"<10k"}
    # The bare relay's arm: its own CPU and TTFT, the replies byte-identical, nothing stored.
    relay = result["arms"]["relay"]
    assert relay["pass"] and relay["identical"] == "9/9"
    assert set(relay["cpu_ms_alone"]) == {"<10k"}
    assert "bytes_per_unique_token" not in relay
    # Each proxy's idle CPU was read; the rows beside the relay's are printed.
    assert all(result["arms"][a]["idle_ms_s"] >= 0 for a in ("relay", "sqlite", "pg"))
    assert {row[0] for row in result["targets"]} >= {
        "throughput kept vs direct, all sessions, unpaced",
        "idle CPU, ms per s (1 = 0.1% of a core)", "database bytes per unique token"}
    assert "beside the bare relay" in out, out


def test_replicas_bench_measures_every_size_and_the_database_load(postgres):
    if (shutil.which("haproxy") is None and not Path("/usr/sbin/haproxy").exists()
            and not os.environ.get("CI")):
        pytest.skip("haproxy not installed (apt-get install haproxy; .ci/run does)")
    out = run("replicas_bench.py", "--seconds", "0.4", "--rounds", "1", "--concurrency", "8")
    # Exit 0 means no failed call and every call of the database run was written.
    for target in ("direct", "replica-1-direct", "haproxy-1", "haproxy-2", "haproxy-4"):
        assert re.search(rf"^\| {target} \|", out, re.M), out
    assert re.search(r"rows inserted per 1,000 calls: [1-9]", out), out


def test_replica_cpu_bench_prints_every_figure_for_the_replica_and_haproxy(postgres):
    if (shutil.which("haproxy") is None and not Path("/usr/sbin/haproxy").exists()
            and not os.environ.get("CI")):
        pytest.skip("haproxy not installed (apt-get install haproxy; .ci/run does)")
    out = run("replica_cpu.py", "--idle-seconds", "1", "--calls", "40", "--concurrency", "4",
              "--json")
    for who in ("replica", "haproxy"):
        assert re.search(rf"^\| {who} \|( [^|]+ \|){{5}}$", out, re.M), out
    figures = json.loads(out[out.index("{"):])
    assert figures["call"]["replica"] > 0 and figures["stream_long"]["replica"] > 0
    assert set(figures["idle_checked"]) == {"replica", "haproxy"}



def test_the_screenshot_replay_stores_each_image_once_through_either_api():
    lines = [json.loads(line) for line in run(
        "image_bytes.py", "--db", "sqlite", "--turns", "4", "--image-kb", "40",
        "--image-tokens", "8").splitlines()]
    assert [line["api"] for line in lines] == ["chat", "messages"]
    for line in lines:  # each screenshot once, not once per turn or per JSON shape
        assert 0.9 < line["bytes_per_image_byte"] < 1.5, line


def test_flavor_compare_prints_both_flavours_whose_stored_ids_agree(postgres):
    out = run("flavor_compare.py", "--contexts", "300", "2000", "--rounds", "1",
              "--turns", "1", "--concurrency", "2", timeout=180)
    rows = re.findall(r"^\s+(\d+)\s+(sqlite|pg)\s+(\d+)\s+(\d+)\s+[+-]\d+ \(", out, re.MULTILINE)
    assert [(r[0], r[1]) for r in rows] == [("300", "sqlite"), ("300", "pg"),
                                            ("2000", "sqlite"), ("2000", "pg")], out
    # every call of the openai flavour stored with the ids the vLLM flavour's engine gave
    assert "ids: 16 calls compared between the flavours, 0 differ" in out, out


def test_idle_serve_reads_each_idle_proxys_cpu():
    out = run("idle_serve.py", "--arm", f"here:{BENCH.parent}:sqlite", "--seconds", "0.5",
              "--reps", "1", "--settle", "0.2", timeout=120)
    [line] = [row for row in out.splitlines() if row.startswith("here ")]
    assert float(line.split()[2]) >= 0  # min ms/s, a number
