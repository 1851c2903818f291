"""``tracetap run --space`` end to end (a real proxy and mock engine, the openai SDK in
the harness), and the admin endpoint it builds on, GET /tracetap/harness-configs, on
both databases."""

from __future__ import annotations

import itertools
import json
import sys
from collections import Counter
from pathlib import Path

from tracetap.cli import main

SCRIPTS = Path(__file__).parent / "run_scripts"
HARNESS = (
    f"{sys.executable} {SCRIPTS / 'harness.py'} {{base_url}} {{task.id}} {{config.context}} "
    "{episode} "
)
SPACE = {"context": ["full", "window", "summary"], "retries": [0, 3, 5], "tools": ["a", "b", "c"]}


def _tasks(where: Path, names: list[str]) -> Path:
    (where / "tasks").mkdir(parents=True, exist_ok=True)
    path = where / f"tasks-{len(names)}-{names[0]}.jsonl"
    with open(path, "w") as f:
        for name in names:
            f.write(json.dumps({"id": name}) + "\n")
            (where / "tasks" / f"{name}.json").write_text("{}")
    return path


def _run(proxy, where: Path, tasks: Path, capsys, *extra: str) -> dict:
    (where / "space.json").write_text(json.dumps(SPACE))
    code = main(
        [
            "run",
            "--proxy",
            proxy.url,
            "--admin-token",
            proxy.admin_token,
            "--tasks",
            str(tasks),
            "--harness",
            HARNESS + str(where),
            "--harness-name",
            "h",
            "--space",
            str(where / "space.json"),
            "--json",
            *extra,
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    return {**json.loads(out), "stderr": err}


def _configs(proxy) -> list[tuple[str, dict]]:
    status, page = proxy.admin("GET", "/tracetap/episodes?limit=1000")
    assert status == 200
    return [(e["task_id"], e["harness"]["config"]) for e in page["data"]]


def _pairs(configs) -> set:
    return {(f, c[f], g, c[g]) for c in configs for f, g in itertools.combinations(SPACE, 2)}


def test_configs_are_assigned_balanced_and_a_second_run_fills_the_gaps(proxy, tmp_path, capsys):
    first_tasks = _tasks(tmp_path, ["t1", "t2"])
    first = _run(proxy, tmp_path, first_tasks, capsys, "--configs-per-task", "2")
    assert (first["episodes"], first["ran"]) == (4, 4)
    assert first["space"]["prior_assignments"] == 0 and first["space"]["new_assignments"] == 4
    ran = _configs(proxy)
    by_task = {t: [c for u, c in ran if u == t] for t in ("t1", "t2")}
    # Each task meets two different configs; the numbers stay numbers.
    assert all(len(cs) == 2 and cs[0] != cs[1] for cs in by_task.values())
    assert all(isinstance(c["retries"], int) for _, c in ran)
    for factor in SPACE:  # 4 assignments over 3 levels: 2, 1, 1
        assert sorted(Counter(c[factor] for _, c in ran).values()) == [1, 1, 2]
    assert first["space"]["uncovered"] == 27 - len(_pairs(c for _, c in ran))

    # The same command line again: the same episodes, all skipped.
    again = _run(proxy, tmp_path, first_tasks, capsys, "--configs-per-task", "2")
    assert (again["ran"], again["skipped"]) == (0, 4)
    assert again["run_id"] == first["run_id"] and again["space"] == first["space"]
    assert again["stderr"].count("space:") == 1

    # A second run (other tasks, so another run id) builds on the first's four.
    second = _run(
        proxy,
        tmp_path,
        _tasks(tmp_path, ["t3", "t4", "t5", "t6"]),
        capsys,
        "--configs-per-task",
        "2",
    )
    assert second["run_id"] != first["run_id"]
    assert second["space"]["prior_assignments"] == 4
    assert second["space"]["uncovered"] == 0 and second["space"]["covered_after"] == 6
    assert (
        "space: 27 level pairs, 4 assignments already run; 8 new (2 configs per task): every "
        "pair covered after 6 new assignments; each factor's levels used equally often"
    ) in second["stderr"]
    every = [c for _, c in _configs(proxy)]
    assert len(every) == 12 and len(_pairs(every)) == 27
    for factor in SPACE:  # 12 over 3 levels: 4 each
        assert sorted(Counter(c[factor] for c in every).values()) == [4, 4, 4]
    # Its rerun still sees only what ran before it started: nothing changes.
    rerun = _run(
        proxy,
        tmp_path,
        _tasks(tmp_path, ["t3", "t4", "t5", "t6"]),
        capsys,
        "--configs-per-task",
        "2",
    )
    assert (rerun["ran"], rerun["skipped"]) == (0, 8) and rerun["space"] == second["space"]


def test_space_mistakes_are_bad_input(proxy, tmp_path, capsys):
    tasks = _tasks(tmp_path, ["t1"])
    (tmp_path / "space.json").write_text(json.dumps({"context": ["a", "a"]}))
    base = [
        "run",
        "--proxy",
        proxy.url,
        "--admin-token",
        proxy.admin_token,
        "--tasks",
        str(tasks),
        "--harness",
        "true",
        "--space",
        str(tmp_path / "space.json"),
    ]
    assert main(base) == 2
    assert "factor 'context' lists a level twice" in capsys.readouterr().err
    (tmp_path / "space.json").write_text(json.dumps({"context": ["a", "b"]}))
    assert main([*base, "--config", "context=a"]) == 2
    assert "without --configs/--config" in capsys.readouterr().err
    assert main([*base, "--configs-per-task", "3"]) == 2
    assert "the space holds only 2 configurations" in capsys.readouterr().err


def test_the_harness_configs_endpoint(proxy, capsys):
    def register(episode_id: str, task: str, config: dict, name: str = "h") -> None:
        status, _ = proxy.admin(
            "POST",
            "/tracetap/episodes",
            {"id": episode_id, "task_id": task, "harness": {"name": name, "config": config}},
        )
        assert status == 201

    register("old.1", "t1", {"a": 1})
    register("old.2", "t1", {"a": 1})
    register("other.1", "t1", {"a": 1}, name="g")
    register("run.t1.a0", "t2", {"a": 2})
    register("late.1", "t3", {"a": 3})  # after the run's first episode
    status, body = proxy.admin("GET", "/tracetap/harness-configs?harness=h")
    assert status == 200 and body["before"] is None
    assert sorted((r["task_id"], r["config"]["a"], r["episodes"]) for r in body["data"]) == [
        ("t1", 1, 2),
        ("t2", 2, 1),
        ("t3", 3, 1),
    ]
    status, body = proxy.admin("GET", "/tracetap/harness-configs?harness=h&exclude_prefix=run.")
    assert status == 200 and body["before"] is not None
    assert [(r["task_id"], r["episodes"]) for r in body["data"]] == [("t1", 2)]
    status, body = proxy.admin("GET", "/tracetap/harness-configs")
    assert status == 400 and "harness" in body["error"]["message"]
    status, _ = proxy.admin("GET", "/tracetap/harness-configs?harness=h", token="wrong")
    assert status == 401
