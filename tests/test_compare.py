"""``tracetap compare``: Δ_B and its statistics against a direct computation on the seed."""

from __future__ import annotations

import asyncio
import math
import random

import numpy as np
import pytest
from helpers.seeding import SECONDS, SUCCESS, TASKS, TOKENS, cli_json, seed

from tracetap import cli
from tracetap.analysis import stats


def compare(db: str, capsys, *flags: str) -> dict:
    return cli_json(capsys, "compare", "--db", db, *flags)


def direct(d: list[float], resamples: int, seed: int) -> tuple[float, float]:
    """The documented paired bootstrap, written out: resample tasks, percentiles."""
    rng = random.Random(seed)
    means = [sum(rng.choices(d, k=len(d))) / len(d) for _ in range(resamples)]
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def binomial_two_sided(k: int, n: int) -> float:
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(min(k, n - k) + 1)) / 2**n)


def test_delta_interval_p_value_flips_and_costs_match_a_direct_computation(db_url, capsys):
    asyncio.run(seed(db_url))
    result = compare(
        db_url,
        capsys,
        "--baseline",
        "harness=A",
        "--candidate",
        "harness=B",
        "--resamples",
        "500",
        "--seed",
        "7",
    )
    d = [SUCCESS["B"][t] - SUCCESS["A"][t] for t in TASKS]
    [b] = result["candidates"]
    assert b["paired_tasks"] == 6 and b["unpaired_tasks"] == []
    assert b["delta"] == pytest.approx(sum(d) / 6) == pytest.approx(1 / 6)
    assert b["interval"] == pytest.approx(direct(d, 500, 7), abs=1e-12)
    positive = sum(x > 0 for x in d)
    assert b["p_value"] == pytest.approx(binomial_two_sided(positive, 4)) == pytest.approx(0.625)
    assert b["flips"] == {"fixed": ["t3", "t4", "t5"], "broken": ["t2"], "unchanged": 2}
    assert b["reward_delta"] == pytest.approx(1 / 6)  # reward 1 on success, 0 otherwise
    per_episode = {h: 2 * sum(TOKENS[h]) for h in "AB"}  # two calls an episode
    assert b["tokens_delta"] == pytest.approx(per_episode["B"] - per_episode["A"])
    assert b["latency_delta"] == pytest.approx(2 * (SECONDS["B"] - SECONDS["A"]))
    assert b["advantage"] is None  # one candidate: no group
    # A-t4-0's upstream failed: infra, left out (its task t4 still has A-t4-1).
    assert result["baseline"]["infra_excluded"] == 1
    assert b["variant"]["infra_excluded"] == 0
    assert result["baseline"]["success_rate"] == pytest.approx(5 / 11)
    assert b["variant"]["success_rate"] == pytest.approx(7 / 12)
    assert (result["resamples"], result["seed"]) == (500, 7)


def test_the_same_seed_gives_the_same_interval_and_another_seed_another(seeded, capsys):
    flags = ("--baseline", "harness=A", "--candidate", "harness=B", "--resamples", "20")
    one = compare(seeded, capsys, *flags)["candidates"][0]["interval"]
    assert compare(seeded, capsys, *flags)["candidates"][0]["interval"] == one
    assert compare(seeded, capsys, *flags, "--seed", "1")["candidates"][0]["interval"] != one


def test_k_candidates_get_group_normalised_advantages(seeded, capsys):
    # overlay=o1 marks B's second repeats: on t5 that repeat failed.
    result = compare(
        seeded,
        capsys,
        "--baseline",
        "harness=A",
        "--candidate",
        "harness=B",
        "--candidate",
        "overlay=o1",
        "--candidate",
        "harness=B,config.prompt=short",
    )
    deltas = [c["delta"] for c in result["candidates"]]
    assert deltas == pytest.approx([1 / 6, 0.5 / 6, 1.5 / 6])
    m = sum(deltas) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in deltas) / 3)
    assert [c["advantage"] for c in result["candidates"]] == pytest.approx(
        [(x - m) / sd for x in deltas]
    )


def test_selectors_by_policy_and_config_and_the_table(seeded, capsys):
    result = compare(
        seeded,
        capsys,
        "--baseline",
        "harness=A,policy=v1",
        "--candidate",
        "config.context=window,policy=v1",
    )
    [c] = result["candidates"]
    # (Not v0: A-t4-0 is infra, left out, which would leave t4 unpaired.)
    assert (result["baseline"]["episodes"], c["variant"]["episodes"]) == (6, 6)
    # Repeat 1 fails wherever the task's rate is 0.5: A t3 fails, B t5 too.
    assert c["flips"] == {"fixed": ["t3", "t4"], "broken": ["t2"], "unchanged": 3}
    assert (
        cli.main(["compare", "--db", seeded, "--baseline", "harness=A", "--candidate", "harness=B"])
        == 0
    )
    table = capsys.readouterr().out
    assert "harness=B" in table and "+0.167" in table and "0.625" in table
    assert "left out of 'harness=A': 1 episodes with integrity infra" in table


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--baseline", "harness=Z", "--candidate", "harness=B"),
            "the baseline selection 'harness=Z' matches none of the 24 episodes",
        ),
        (
            ("--baseline", "harness=A", "--candidate", "harness=B,task=t1"),
            "5 tasks ran under only one of the baseline 'harness=A' and the candidate "
            "'harness=B,task=t1' (baseline only: t2, t3, t4 and 2 more; candidate only: none)",
        ),
        (("--baseline", "harness=A,task=t1", "--candidate", "harness=B,task=t2"), "share no task"),
        (
            ("--baseline", "harness=A", "--candidate", "config.retries=0"),
            "12 episodes match both the baseline",
        ),
        (("--baseline", "harnes=A", "--candidate", "harness=B"), "unknown key 'harnes'"),
    ],
)
def test_empty_unpaired_and_overlapping_selections_are_clear_errors(seeded, capsys, flags, message):
    assert cli.main(["compare", "--db", seeded, *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tracetap compare: error: ") and message in err, err


def test_unpaired_tasks_are_dropped_only_when_asked(seeded, capsys):
    result = compare(
        seeded,
        capsys,
        "--baseline",
        "harness=A",
        "--candidate",
        "harness=B,task=t4",
        "--allow-unpaired",
    )
    [c] = result["candidates"]
    assert c["paired_tasks"] == 1 and c["delta"] == 1.0
    assert c["unpaired_tasks"] == ["t1", "t2", "t3", "t5", "t6"]


def test_statistics_against_known_values():
    assert stats.sign_test([1, 1, 1, 1, 1]) == pytest.approx(2 / 32)
    assert stats.sign_test([0, 0]) is None
    assert stats.sign_test([1, -1]) == 1.0
    low, high = stats.wilson(5, 10)
    assert (low, high) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    values = sorted(random.Random(3).random() for _ in range(101))
    for q in (2.5, 50, 97.5):
        assert stats.percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert stats.normalised([1.0, 1.0]) == [0.0, 0.0]


def test_held_out_delta_is_the_same_statistic_on_the_tasks_outside_the_packets(seeded, capsys):
    flags = ("--baseline", "harness=A", "--candidate", "harness=B", "--resamples", "300",
             "--seen-task", "t3", "--seen-task", "t4")
    result = compare(seeded, capsys, *flags)
    [b] = result["candidates"]
    outside = ["t1", "t2", "t5", "t6"]
    d = [SUCCESS["B"][t] - SUCCESS["A"][t] for t in outside]
    assert b["held_out"]["tasks"] == 4
    assert b["held_out"]["delta"] == pytest.approx(sum(d) / 4)
    assert b["held_out"]["interval"] == pytest.approx(direct(d, 300, 0), abs=1e-12)
    assert b["delta"] == pytest.approx(1 / 6)  # the in-batch figure, beside it
    assert (result["reward"], b["reward"]) == ("held-out", b["held_out"]["delta"])
    chosen = compare(seeded, capsys, *flags, "--reward", "in-batch")
    assert (chosen["reward"], chosen["candidates"][0]["reward"]) == ("in-batch", b["delta"])
    assert cli.main(["compare", "--db", seeded, *flags]) == 0
    assert "held out (4 tasks not in its packets): Δ_B" in capsys.readouterr().out
    # Every task seen: no held-out figure, so the reward is in-batch unless asked.
    every = [f for t in TASKS for f in ("--seen-task", t)]
    none = compare(seeded, capsys, "--baseline", "harness=A", "--candidate", "harness=B",
                   *every)
    assert none["candidates"][0]["held_out"]["delta"] is None and none["reward"] == "in-batch"
    assert cli.main(["compare", "--db", seeded, "--baseline", "harness=A", "--candidate",
                     "harness=B", *every, "--reward", "held-out"]) == 1
    assert "--reward held-out needs" in capsys.readouterr().err


def test_invalid_candidates_enter_the_group_with_their_penalty(seeded, capsys):
    result = compare(seeded, capsys, "--baseline", "harness=A", "--candidate", "harness=B",
                     "--candidate", "overlay=o1", "--invalid", "did-not-load",
                     "--penalty", "-1")
    rewards = [1 / 6, 0.5 / 6, -1.0]
    m = sum(rewards) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in rewards) / 3)  # population std, as GRPO
    got = [c["advantage"] for c in result["candidates"]] + [result["invalid"][0]["advantage"]]
    assert got == pytest.approx([(x - m) / sd for x in rewards])
    assert result["invalid"][0] == {"label": "did-not-load", "reward": -1.0,
                                    "advantage": got[2]}


def test_the_demo_group_gives_the_advantages_the_trainer_computes():
    assert [round(a, 3) for a in stats.normalised([0.375, 0.0, -1.0])] == [1.005, 0.359, -1.364]
