"""``tracetap run`` end to end: a real proxy and mock engine, a harness that is a Python
script using the openai SDK at its ``{base_url}``, a grader, and the runner speaking only
HTTP to the proxy's admin API."""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tracetap.analysis.episodes import load
from tracetap.analysis.integrity import clean
from tracetap.analysis.runner import grade, plan
from tracetap.analysis.runner.episode import Result
from tracetap.analysis.runner.progress import Progress
from tracetap.analysis.runner.template import TemplateError, argv, fill
from tracetap.cli import main
from tracetap.storage.scan import EpisodeFilter

# Not in helpers/: a script's folder comes first on its path, and helpers/http.py would
# shadow the standard library's http.
SCRIPTS = Path(__file__).parent / "run_scripts"
HARNESS = (
    f"{sys.executable} {SCRIPTS / 'harness.py'} {{base_url}} {{task.id}} "
    "{config.style} {episode} "
)


@pytest.fixture
def db_url(tmp_path) -> str:
    """SQLite only: the runner reaches the database through the proxy alone, whose
    storage tests cover both databases."""
    from tracetap.migrations import upgrade

    url = f"sqlite:///{tmp_path / 'tracetap.db'}"
    upgrade(url)
    return url


def _tasks(where: Path, tasks: dict[str, dict]) -> Path:
    (where / "tasks").mkdir(parents=True)
    with open(where / "tasks.jsonl", "w") as f:
        for task_id, behaviour in tasks.items():
            f.write(json.dumps({"id": task_id, **behaviour}) + "\n")
            (where / "tasks" / f"{task_id}.json").write_text(json.dumps(behaviour))
    return where / "tasks.jsonl"


def _args(proxy, where: Path, *extra: str) -> list[str]:
    return [
        "run",
        "--proxy",
        proxy.url,
        "--admin-token",
        proxy.admin_token,
        "--tasks",
        str(where / "tasks.jsonl"),
        "--harness",
        HARNESS + str(where),
        "--logs",
        str(where / "logs"),
        *extra,
    ]


def _summary(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def _alive(pid: int) -> bool:
    """Running (a killed child whose parent died stays a zombie until someone reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _episodes(proxy) -> list[dict]:
    status, page = proxy.admin("GET", "/tracetap/episodes")
    assert status == 200
    return page["data"]


def _started(where: Path) -> list[str]:
    path = where / "started"
    return [line.split()[0] for line in path.read_text().splitlines()] if path.exists() else []


def test_episodes_are_registered_run_at_their_base_url_and_graded(proxy, tmp_path, capsys):
    _tasks(tmp_path, {"t1": {}, "t2": {}})
    grader = f"{sys.executable} {SCRIPTS / 'grader.py'} {{episode}} {tmp_path} {{exit_code}}"
    code = main(
        _args(
            proxy,
            tmp_path,
            "--grader",
            grader,
            "--config",
            "style=a",
            "--config",
            "style=b,temperature=0.5",
            "--run-id",
            "r1",
            "--harness-name",
            "scripted",
            "--json",
        )
    )
    assert code == 0
    summary = _summary(capsys)
    assert (summary["episodes"], summary["ran"], summary["skipped"]) == (4, 4, 0)
    assert [(c["config"], c["mean_reward"]) for c in summary["configs"]] == [
        ({"style": "a"}, 0.25),
        ({"style": "b", "temperature": 0.5}, 0.75),
    ]
    ids = {p.stem for p in (tmp_path / "out").iterdir()}
    assert len(ids) == 4
    for episode_id in ids:
        out = json.loads((tmp_path / "out" / f"{episode_id}.json").read_text())
        episode = proxy.episode(episode_id)
        style = out["argv"][2]
        assert episode["task_id"] == out["argv"][1]
        assert episode["group_id"] == f"r1.{episode['task_id']}"
        assert episode["harness"]["name"] == "scripted"
        assert episode["harness"]["config"]["style"] == style
        assert episode["metadata"] == {"run": "r1", "repeat": 0, "attempt": 0}
        assert episode["reward"] == (0.25 if style == "a" else 0.75)
        assert episode["rewards"] == {"style_b": float(style == "b")}
        assert episode["outcome"] == f"graded-{episode['task_id']}-0"
        # The harness got its episode's own base URL (with its key) as one argument,
        # in its environment too, and its call was captured under that episode.
        assert out["argv"][0] == out["env_base_url"]
        assert f"/episodes/{episode_id}~" in out["argv"][0]
        assert out["env_episode"] == episode_id
        assert not out["admin_token_leaked"]
        assert [c["status"] for c in proxy.calls(episode_id)] == ["ok"]


def test_reward_from_exit_status_and_a_timeout_kills_the_process_group(proxy, tmp_path, capsys):
    said = "noise\n" * 1000 + "Error: tests/test_x.py failed: no module named x\n"
    _tasks(tmp_path, {"ok": {}, "bad": {"exit": 3, "stderr": said}, "slow": {"sleep": 30}})
    # 10 s: the harness imports the openai SDK, which alone took over 4 s at a load of 11.
    code = main(
        _args(proxy, tmp_path, "--config", "style=a", "--timeout", "10", "--run-id", "r2", "--json")
    )
    assert code == 0
    summary = _summary(capsys)
    assert (summary["ran"], summary["failed"], summary["timeout"]) == (3, 1, 1)
    finished = {e["task_id"]: e for e in _episodes(proxy)}
    assert (finished["ok"]["reward"], finished["ok"]["outcome"]) == (1.0, "success")
    assert (finished["bad"]["reward"], finished["bad"]["outcome"]) == (0.0, "failure")
    # Why it failed, in its own words: the end of its stderr (all of it is in its log).
    tail = said.strip()[-2000:]
    assert finished["bad"]["info"] == {"exit_code": 3, "harness_stderr": tail}
    assert said in (tmp_path / "logs" / f"{finished['bad']['id']}.log").read_text()
    assert "harness_stderr" not in (finished["ok"]["info"] or {})
    assert main(["packets", "--db", proxy.settings.database_url, "--out",
                 str(tmp_path / "packets"), "--where", "task=bad"]) == 0
    (packet,) = [json.loads(line) for line in (tmp_path / "packets" / "packets.jsonl")
                 .read_text().splitlines()]
    assert packet["outcome"]["harness_output"].endswith("Error: tests/test_x.py failed: "
                                                        "no module named x")
    assert (finished["slow"]["reward"], finished["slow"]["outcome"]) == (0.0, "timeout")
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 5  # SIGKILL is delivered, not awaited, for the child
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the harness's child outlived the timeout"


def test_concurrency_runs_harnesses_side_by_side_and_no_more(proxy, tmp_path, capsys):
    # Each harness waits (up to 15 s) until two run at once and records how many it saw:
    # run one at a time, each would see only itself.
    _tasks(tmp_path, {f"t{i}": {"barrier": 2} for i in range(4)})
    assert (
        main(
            _args(
                proxy,
                tmp_path,
                "--config",
                "style=a",
                "--concurrency",
                "2",
                "--run-id",
                "r3",
                "--json",
            )
        )
        == 0
    )
    outs = [json.loads(p.read_text()) for p in (tmp_path / "out").iterdir()]
    assert [o["seen"] for o in outs] == [2, 2, 2, 2]
    # A harness holds its marker from start to exit: more than two at once would show.
    assert max(o["peak"] for o in outs) == 2
    assert _summary(capsys)["ran"] == 4


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "sigkill"])
def test_an_interrupted_run_resumes_without_redoing_finished_episodes(proxy, tmp_path, sig,
                                                                      request):
    _tasks(tmp_path, {"t0": {}, "t1": {}, "t2": {"block": True}, "t3": {}})
    (tmp_path / "block").touch()
    args = [
        sys.executable,
        "-m",
        "tracetap",
        *_args(proxy, tmp_path, "--config", "style=a", "--concurrency", "1", "--json"),
    ]
    # Ctrl-C as a terminal sends it: a run started from a background job (CI's, say)
    # inherits SIGINT ignored, and Python then never raises KeyboardInterrupt.
    first = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    request.addfinalizer(lambda: _reaped(first))
    deadline = time.monotonic() + 90  # a loaded machine starts three harnesses slowly
    while "t2" not in _started(tmp_path) and time.monotonic() < deadline:
        if first.poll() is not None:
            break
        time.sleep(0.05)
    if _started(tmp_path) != ["t0", "t1", "t2"]:
        first.kill()
        _, err = first.communicate(timeout=30)
        raise AssertionError(f"started {_started(tmp_path)}: {err.decode()[-2000:]}")
    first.send_signal(sig)
    first.communicate(timeout=30)
    assert first.returncode == (130 if sig == signal.SIGINT else -signal.SIGKILL)
    # A killed runner leaves its harness running (it has a session of its own): let it
    # end before the proxy it calls is stopped.
    orphan = int((tmp_path / "started").read_text().splitlines()[2].split()[2])
    (tmp_path / "block").unlink()  # the rerun's t2 runs through (and a killed one ends)
    rerun = subprocess.run(args, capture_output=True, text=True, timeout=60)
    deadline = time.monotonic() + 30
    while _alive(orphan) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rerun.returncode == 0, rerun.stderr
    summary = json.loads(rerun.stdout)
    assert (summary["ran"], summary["skipped"]) == (2, 2)
    assert summary["interrupted"] == 1
    assert sorted(_started(tmp_path)) == ["t0", "t1", "t2", "t2", "t3"]
    episodes = {e["id"]: e for e in _episodes(proxy)}
    by_task: dict[str, list[dict]] = {}
    for e in episodes.values():
        by_task.setdefault(e["task_id"], []).append(e)
    assert {t: len(es) for t, es in by_task.items()} == {"t0": 1, "t1": 1, "t2": 2, "t3": 1}
    first_attempt, second = sorted(by_task["t2"], key=lambda e: e["metadata"]["attempt"])
    assert first_attempt["id"].endswith(".a0") and second["id"].endswith(".a1")
    assert first_attempt["outcome"] == "interrupted" and first_attempt["reward"] is None
    assert (second["outcome"], second["reward"]) == ("success", 1.0)
    assert all(e["finished_at"] is not None for e in episodes.values())
    # Harness engineering reads the interrupted attempt as an infra episode: compare and
    # packets leave it out (docs/harness-engineering.md, "Infra episodes").
    kept, infra = clean(load(proxy.settings.db, EpisodeFilter()))
    assert infra == 1 and first_attempt["id"] not in {e.id for e in kept}
    assert len(kept) == 4


def _reaped(process: subprocess.Popen) -> None:
    """A runner the test left running (it failed) killed and its pipes closed, so
    nothing of it is left for a later test to trip on."""
    if process.poll() is None:
        process.kill()
    process.communicate(timeout=30)


def test_a_filled_value_is_one_argument_and_never_shell_syntax(tmp_path):
    values = {"task": {"prompt": "a b; rm -rf $HOME 'x'"}, "episode": "e1"}
    assert argv("run --p {task.prompt} {episode}", values, shell=False, what="t") == [
        "run",
        "--p",
        "a b; rm -rf $HOME 'x'",
        "e1",
    ]
    echoed = subprocess.run(
        argv("printf %s {task.prompt}", values, shell=True, what="t"),
        capture_output=True,
        text=True,
        check=True,
    )
    assert echoed.stdout == "a b; rm -rf $HOME 'x'"
    assert fill("{{literal}} {episode}", values) == "{literal} e1"
    with pytest.raises(TemplateError, match=r"\{task.missing\}"):
        fill("{task.missing}", values)
    with pytest.raises(TemplateError, match=r"unknown field \{nope\}"):
        fill("{nope}", values)


def test_a_template_naming_a_field_a_task_lacks_fails_before_anything_runs(proxy, tmp_path, capsys):
    _tasks(tmp_path, {"t1": {"prompt": "x"}, "t2": {}})
    args = [
        "run",
        "--proxy",
        proxy.url,
        "--admin-token",
        proxy.admin_token,
        "--tasks",
        str(tmp_path / "tasks.jsonl"),
        "--harness",
        "echo {task.prompt}",
    ]
    assert main(args) == 2
    assert "task 't2': --harness: {task.prompt}: task has no field 'prompt'" in (
        capsys.readouterr().err
    )
    assert _episodes(proxy) == []


def test_grader_output_is_the_last_line_a_number_or_an_object():
    assert grade.from_output(b"log\n0.5\n").reward == 0.5
    done = grade.from_output(b'{"reward": 1, "rewards": {"tests": 0.5}, "outcome": "solved"}')
    assert (done.reward, done.rewards, done.outcome) == (1.0, {"tests": 0.5}, "solved")
    for bad in (b"", b"passed\n", b'"text"', b'{"reward": "high"}', b'{"score": 1}'):
        with pytest.raises(grade.GraderError):
            grade.from_output(bad)


def test_episode_ids_are_deterministic_and_valid_for_any_task_id():
    tasks = [plan.Task("django/1234 #2", {}), plan.Task("django_1234__2", {})]
    slots = plan.slots("r", tasks, [{"a": 1}, {"a": 2}], 2, "{run_id}.{task_id}")
    ids = [s.episode_id(0) for s in slots]
    assert len(set(ids)) == 8
    assert ids == [
        s.episode_id(0)
        for s in plan.slots("r", tasks, [{"a": 1}, {"a": 2}], 2, "{run_id}.{task_id}")
    ]
    assert all(re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", i) for i in ids)
    assert all(re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", s.group) for s in slots)
    assert plan.default_run_id(["t"], [{}]) == plan.default_run_id(["t"], [{}])
    assert plan.parse_config("context=window, retries=3,t=0.7") == {
        "context": "window",
        "retries": 3,
        "t": 0.7,
    }


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _result(outcome: str, status: str = "ran") -> Result:
    slot = plan.slots("r", [plan.Task("t", {})], [{}], 1, "{run_id}")[0]
    return Result(slot, "e", status, 0.0, outcome)


def test_progress_rewrites_one_line_on_a_terminal_and_prints_lines_now_and_then_otherwise():
    now = [0.0]
    tty = Progress(3, _Stream(True), clock=lambda: now[0])
    for outcome in ("success", "timeout"):
        tty.start()
        tty.finished(_result(outcome))
    tty.start()
    tty.finished(_result("success", "skipped"))
    tty.close()
    text = tty.stream.getvalue()
    assert text.count("\r\033[K") == 6 and text.endswith("\n") and text.count("\n") == 1
    assert "3/3 running 0, skipped 1, timeout 1" in text

    logged = Progress(3, _Stream(False), clock=lambda: now[0])
    logged.start()  # the first line, then one per 5 s, and the last
    logged.finished(_result("success"))
    now[0] = 6.0
    logged.start()
    logged.finished(_result("success"))
    logged.start()
    logged.finished(_result("failure"))
    lines = logged.stream.getvalue().splitlines()
    assert [line.split("]")[1].split(" running")[0] for line in lines] == [" 0/3", " 1/3", " 3/3"]
