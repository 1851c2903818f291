"""``tracetap harnesses``: factor coverage of the seed, the covering design, factor files."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import pytest
from helpers.seeding import cli_json, seed

from tracetap import cli
from tracetap.analysis.arrays import orthogonal_array
from tracetap.analysis.design import Space, constructed, cover


def harnesses(db: str, capsys, *flags: str) -> dict:
    return cli_json(capsys, "harnesses", "--db", db, *flags)


def test_levels_outcomes_and_pairs_never_run(db_url, capsys):
    asyncio.run(seed(db_url))
    report = harnesses(db_url, capsys)
    assert report["episodes"] == 24 and report["factors"] == ["context", "prompt", "retries"]
    rows = {(r["factor"], r["level"]): r for r in report["levels"]}
    assert {k: r["episodes"] for k, r in rows.items()} == {
        ("context", "full"): 12,
        ("context", "window"): 12,
        ("prompt", "long"): 12,
        ("prompt", "short"): 12,
        ("retries", "0"): 12,
        ("retries", "3"): 12,
    }
    full = rows[("context", "full")]  # harness A: 5 of 12 succeeded
    assert full["success_rate"] == pytest.approx(5 / 12) == pytest.approx(full["mean_reward"])
    low, high = full["success_interval"]
    assert low < 5 / 12 < high
    # context and retries follow the harness: A is (full, 0), B (window, 3).
    assert report["unseen_pairs"] == [
        ["context", "full", "retries", "3"],
        ["context", "window", "retries", "0"],
    ]
    assert report["pairs"] == 12


def test_a_space_adds_levels_never_run_and_proposes_a_covering_design(seeded, capsys, tmp_path):
    space = tmp_path / "factors.yaml"
    space.write_text("context: [full, window]\nretries: [0, 3]\nprompt: [short, long, medium]\n")
    report = harnesses(seeded, capsys, "--space", str(space), "--select", "6")
    assert report["factors"] == ["context", "retries", "prompt"]
    medium = next(r for r in report["levels"] if r["level"] == "medium")
    assert medium["episodes"] == 0 and medium["success_rate"] is None
    assert ["context", "full", "prompt", "medium"] in report["unseen_pairs"]
    design = report["design"]
    assert len(design["configs"]) == 6 and design["lower_bound"] == 6
    covered = {
        (f, c[f], g, c[g]) for c in design["configs"] for f, g in itertools.combinations(c, 2)
    }
    assert len(covered) == design["pairs"] == 4 + 6 + 6 and design["uncovered"] == 0
    assert cli.main(["harnesses", "--db", seeded, "--space", str(space), "--select", "6"]) == 0
    assert "proposed 6 configurations (all 16 pairs covered by the first 6" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize(
    "sizes", [(2, 2, 2), (3, 3, 3, 3), (4, 3, 2), (2,) * 10, (5, 4, 3, 3, 2, 2), (3,) * 7, (6,)]
)
def test_the_design_covers_every_pair_and_spreads_them_evenly(sizes):
    space = Space({f"f{i}": [f"l{j}" for j in range(n)] for i, n in enumerate(sizes)})
    design = cover(space, 4 * design_bound(sizes))
    assert design.uncovered == 0 and design.covered_after is not None
    assert design.lower_bound <= design.covered_after <= 2 * design.lower_bound
    first = design.configs[: design.covered_after]
    pairs = {(f, c[f], g, c[g]) for c in first for f, g in itertools.combinations(c, 2)}
    assert len(pairs) == design.pairs
    # Evenly (the documented bound): within each pair of factors, the level pairs'
    # counts differ by at most their mean.
    for f, g in itertools.combinations(space.factors, 2):
        counts = [
            sum(c[f] == a and c[g] == b for c in design.configs)
            for a in space.factors[f]
            for b in space.factors[g]
        ]
        assert max(counts) - min(counts) <= len(design.configs) / len(counts), (f, g, counts)
    # Each factor's levels: within two of each other (greedy favours pairs; the docs).
    for f, levels in space.factors.items():
        used = [sum(c[f] == v for c in design.configs) for v in levels]
        assert max(used) - min(used) <= 2, (f, used)
    assert cover(space, 4 * design_bound(sizes)) == design  # deterministic


# (levels, factors) -> the fewest configurations any design covering every pair needs:
# q² for an orthogonal array (each pair of two q-level factors needs its own row), and
# for two-level factors the known covering array numbers (Kleitman and Spencer 1973).
OPTIMUM = {(3, 3): 9, (3, 4): 9, (4, 5): 16, (5, 5): 25, (7, 8): 49, (8, 9): 64, (9, 4): 81,
           (2, 4): 5, (2, 10): 6, (2, 11): 7, (2, 15): 7, (2, 16): 8, (2, 35): 8, (2, 36): 9}


@pytest.mark.parametrize(("levels", "factors"), sorted(OPTIMUM))
def test_known_constructions_cover_every_pair_in_the_fewest_configurations(levels, factors):
    space = Space({f"f{i}": [f"l{j}" for j in range(levels)] for i in range(factors)})
    design = cover(space, OPTIMUM[levels, factors])
    assert design.uncovered == 0 and design.covered_after == OPTIMUM[levels, factors]
    pairs = {(f, c[f], g, c[g]) for c in design.configs
             for f, g in itertools.combinations(c, 2)}
    assert len(pairs) == design.pairs == factors * (factors - 1) // 2 * levels**2
    for f, names in space.factors.items():  # each level equally often (binary: within one)
        used = [sum(c[f] == v for c in design.configs) for v in names]
        assert max(used) - min(used) <= (1 if levels == 2 else 0), (f, used)
    if levels > 2:  # an orthogonal array: each pair exactly once
        assert design.pair_min == design.pair_max == 1


@pytest.mark.parametrize("q", [2, 3, 4, 5, 7, 8, 9, 16, 25, 27])
def test_orthogonal_arrays_over_every_prime_power_field(q):
    rows = orthogonal_array(q, q + 1)
    assert len(rows) == q * q
    for i, j in itertools.combinations(range(q + 1), 2):
        assert sorted((r[i], r[j]) for r in rows) == sorted(itertools.product(range(q), repeat=2))


@pytest.mark.parametrize(("q", "k"), [(6, 3), (10, 3), (12, 2), (4, 6), (3, 1)])
def test_no_orthogonal_array_where_none_is_built(q, k):
    assert orthogonal_array(q, k) is None


def test_spaces_no_construction_fits_are_greedy():
    space = Space({"a": ["x", "y", "z"], "b": ["x", "y"], "c": ["x", "y"]})  # mixed levels
    assert constructed(space) is None
    assert cover(space, 6).covered_after == 6


def design_bound(sizes) -> int:
    ordered = sorted(sizes, reverse=True)
    return ordered[0] * (ordered[1] if len(ordered) > 1 else 1)


def test_too_few_configurations_say_how_many_pairs_stay_uncovered(seeded, capsys, tmp_path):
    space = tmp_path / "factors.json"
    space.write_text(json.dumps({"a": [1, 2, 3], "b": [True, False, None]}))
    design = harnesses(seeded, capsys, "--space", str(space), "--select", "4")["design"]
    assert design["uncovered"] == 5 and design["covered_after"] is None
    assert {c["b"] for c in design["configs"]} == {"true", "false", "null"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- a\n- b\n", "must be a mapping of factor -> list of levels"),
        ("a: []\n", "factor 'a' must name a non-empty list of levels"),
        ("a: [x, {b: 1}]\n", "factor 'a' has a level that is not a scalar"),
        ("a: [x, x]\n", "factor 'a' lists a level twice"),
        ("a: [x\nb: [", "is not valid YAML at line"),
    ],
)
def test_malformed_factor_files_are_one_clear_line(seeded, capsys, tmp_path, text, message):
    space = tmp_path / "factors.yaml"
    space.write_text(text)
    assert cli.main(["harnesses", "--db", seeded, "--space", str(space)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tracetap harnesses: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1


def test_other_mistakes_are_clear_errors(seeded, capsys, tmp_path):
    for flags, message in [
        (("--select", "3"), "--select needs --space FILE"),
        (("--space", str(tmp_path / "missing.yaml")), "cannot read the factor space"),
        (("--where", "harness=Z"), "the filters select no episode"),
        (("--group", "none"), "the filters select no episode"),
    ]:
        assert cli.main(["harnesses", "--db", seeded, *flags]) == 1
        assert message in capsys.readouterr().err


def test_episodes_without_factors_are_a_clear_error(db_url, capsys):
    from tracetap.storage import queries
    from tracetap.storage.engine import create_engine

    async def bare() -> None:
        engine = create_engine(db_url)
        await queries.finish_episode(
            engine, "e1", reward=1.0, rewards=None, outcome=None, info=None
        )
        await engine.dispose()

    asyncio.run(bare())
    assert cli.main(["harnesses", "--db", db_url]) == 1
    assert "none of the 1 episodes has harness factors" in capsys.readouterr().err


def test_yaml_is_only_needed_for_yaml(monkeypatch, tmp_path):
    from tracetap.analysis.design import read_space
    from tracetap.analysis.episodes import AnalysisError

    monkeypatch.setitem(__import__("sys").modules, "yaml", None)  # as if not installed
    space = tmp_path / "factors.json"
    space.write_text('{"a": ["x", "y"]}')
    assert read_space(space).factors == {"a": ["x", "y"]}
    (tmp_path / "f.yaml").write_text("a: [x, y]\n")
    with pytest.raises(AnalysisError, match="reading YAML needs PyYAML"):
        read_space(Path(tmp_path / "f.yaml"))
