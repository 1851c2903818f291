"""``tracetap harnesses --held-out``: success on held-out configs against the rest, on the
seed of tests/helpers/seeding.py, whose successes are known (its docstring)."""

from __future__ import annotations

import json

import pytest
from helpers.seeding import cli_json

from tracetap import cli
from tracetap.analysis.held_out import _split
from tracetap.analysis.stats import wilson


def harnesses(db: str, capsys, *flags: str) -> dict:
    return cli_json(capsys, "harnesses", "--db", db, *flags)


def test_held_out_prompt_against_the_rest_overall_per_level_and_per_task(seeded, capsys):
    report = harnesses(seeded, capsys, "--held-out", "config.prompt=long")
    h = report["held_out"]
    assert h["selection"] == ["config.prompt=long"]
    # Second repeats (prompt long): A succeeds t1, t2; B t1, t3, t4. First repeats: A t1,
    # t2, t3; B t1, t3, t4, t5.
    held, rest = h["overall"]["held_out"], h["overall"]["rest"]
    assert (held["episodes"], held["successes"], rest["episodes"], rest["successes"]) == (
        12,
        5,
        12,
        7,
    )
    assert held["success_interval"] == pytest.approx(list(wilson(5, 12)))
    assert h["overall"]["difference"] == pytest.approx(5 / 12 - 7 / 12)
    levels = {(r["factor"], r["level"]): r["split"] for r in h["levels"]}
    full = levels[("context", "full")]  # harness A
    assert (full["held_out"]["successes"], full["rest"]["successes"]) == (2, 3)
    long_ = levels[("prompt", "long")]  # every episode at this level is held out
    assert long_["rest"]["episodes"] == 0 and long_["difference"] is None
    # Per task (both harnesses' episodes): t3 and t5 did worse held out, by 1/2 each.
    d = {t["task_id"]: t["difference"] for t in h["tasks"]}
    assert d == {"t1": 0.0, "t2": 0.0, "t3": -0.5, "t4": 0.0, "t5": -0.5, "t6": 0.0}
    assert h["task_mean_difference"] == pytest.approx(-1 / 6)
    assert h["task_sign_test_p"] == pytest.approx(0.5)  # 2 negative of 2 non-zero
    low, high = h["task_difference_interval"]
    assert low <= -1 / 6 <= high <= 0.0
    assert cli.main(["harnesses", "--db", seeded, "--held-out", "config.prompt=long"]) == 0
    text = capsys.readouterr().out
    assert "held out: config.prompt=long" in text
    assert "tasks that ran both: 6; mean held-out minus rest -0.167" in text


def test_a_file_of_held_out_configs_matches_every_key_of_one_of_them(seeded, capsys, tmp_path):
    configs = tmp_path / "held.jsonl"
    configs.write_text(
        json.dumps({"context": "window", "prompt": "short"})
        + "\n"
        + json.dumps({"context": "full", "retries": 0, "prompt": "long"})
        + "\n"
    )
    h = harnesses(seeded, capsys, "--held-out-file", str(configs))["held_out"]
    # B's first repeats (window, short: 4 of 6 succeed) and A's second (2 of 6).
    assert h["selection"] == [
        '{"context":"window","prompt":"short"}',
        '{"context":"full","retries":"0","prompt":"long"}',
    ]
    assert (h["overall"]["held_out"]["episodes"], h["overall"]["held_out"]["successes"]) == (12, 6)
    # A selector and a file together: an episode matching either is held out.
    both = harnesses(seeded, capsys, "--held-out-file", str(configs), "--held-out", "task=t1")[
        "held_out"
    ]
    assert both["overall"]["held_out"]["episodes"] == 12 + 2


def test_newcombe_interval_matches_his_published_example():
    # Newcombe (1998), Statistics in Medicine 17:873, table II, example (a): 56/70 vs
    # 48/80, method 10: 0.0524 to 0.3339.
    marks = [(None, True, i < 56) for i in range(70)] + [(None, False, i < 48) for i in range(80)]
    split = _split(marks)
    assert split.difference == pytest.approx(0.2)
    assert split.difference_interval == pytest.approx((0.0524, 0.3339), abs=5e-5)


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--held-out", "config.prompt=medium"), "no episode is held out"),
        (("--held-out", "harness=A", "--held-out", "harness=B"), "every episode is held out"),
        (("--held-out", "nonsense"), "is not KEY=VALUE"),
    ],
)
def test_held_out_mistakes_are_one_clear_line(seeded, capsys, flags, message):
    assert cli.main(["harnesses", "--db", seeded, *flags]) == 1
    assert message in capsys.readouterr().err


def test_a_malformed_held_out_file_is_a_clear_error(seeded, capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "full"}\n[1, 2]\n')
    assert cli.main(["harnesses", "--db", seeded, "--held-out-file", str(bad)]) == 1
    assert "config 2 is not a flat {factor: level} object" in capsys.readouterr().err
