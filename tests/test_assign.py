"""analysis.assign: configurations assigned to tasks (``tracetap run --space``). The
promises of its docstring, checked for many spaces, task counts and bases (Hypothesis),
against counts made here from the assignment itself."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracetap.analysis.assign import Prior, assign
from tracetap.analysis.design import Space, cover
from tracetap.analysis.episodes import AnalysisError


def space(*sizes: int) -> Space:
    return Space({f"f{i}": [f"l{j}" for j in range(n)] for i, n in enumerate(sizes)})


def tasks(n: int) -> list[str]:
    return [f"t{i}" for i in range(n)]


def level_counts(sp: Space, configs: list[dict]) -> dict[str, Counter]:
    out = {f: Counter(dict.fromkeys(levels, 0)) for f, levels in sp.factors.items()}
    for c in configs:
        for f in sp.factors:
            out[f][c[f]] += 1
    return out


def uncovered(sp: Space, configs: list[dict]) -> set:
    pairs = {(f, a, g, b) for f, a, g, b in sp.pairs()}
    for c in configs:
        for f, g in itertools.combinations(sp.factors, 2):
            pairs.discard((f, c[f], g, c[g]))
    return pairs


def every(result) -> list[dict]:
    return [c for configs in result.configs.values() for c in configs]


@st.composite
def cases(draw):
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))
    sp = space(*sizes)
    size = 1
    for n in sizes:
        size *= n
    n_tasks = draw(st.integers(1, 12))
    per_task = draw(st.integers(1, min(size, 4)))
    # A basis: earlier assignments, some of this run's tasks, some of others, some off
    # the space (a level it does not list, a factor missing): those count for nothing.
    prior = []
    for _ in range(draw(st.integers(0, 15))):
        config = {f: f"l{draw(st.integers(0, n - 1))}" for f, n in zip(sp.factors, sizes)}
        kind = draw(st.sampled_from(["in", "in", "in", "off", "missing"]))
        if kind == "off":
            config["f0"] = "elsewhere"
        elif kind == "missing":
            config.pop("f0")
        task = draw(st.sampled_from([*tasks(n_tasks), "other", None]))
        prior.append(Prior(task, config))
    return sp, n_tasks, per_task, prior


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_balanced_within_one_distinct_per_task_and_pairs_counted_right(case):
    sp, n_tasks, per_task, prior = case
    result = assign(sp, tasks(n_tasks), per_task, prior)
    new = every(result)
    inside = [
        p.config
        for p in prior
        if set(p.config) == set(sp.factors)
        and all(p.config[f] in sp.factors[f] for f in sp.factors)
    ]
    assert result.assignments == len(new) == n_tasks * per_task
    assert result.prior == len(inside)
    # Each task: exactly per_task configurations, all different.
    for task in tasks(n_tasks):
        mine = [tuple(sorted(c.items())) for c in result.configs[task]]
        assert len(mine) == per_task and len(set(mine)) == per_task
    # Balance: basis and new together, each factor's level counts differ by at most
    # max(1, their spread in the basis).
    before = level_counts(sp, inside)
    after = level_counts(sp, inside + new)
    for f in sp.factors:
        spread_before = max(before[f].values()) - min(before[f].values())
        spread_after = max(after[f].values()) - min(after[f].values())
        assert spread_after <= max(1, spread_before), (f, before[f], after[f])
        assert result.level_spread_after[f] == spread_after
        assert result.level_spread_before[f] == spread_before
    assert result.uncovered == len(uncovered(sp, inside + new))


@settings(max_examples=100, deadline=None)
@given(cases())
def test_the_same_inputs_give_the_same_assignment(case):
    sp, n_tasks, per_task, prior = case
    assert assign(sp, tasks(n_tasks), per_task, prior) == assign(
        sp, tasks(n_tasks), per_task, list(prior)
    )


@pytest.mark.parametrize(
    "sizes",
    [
        (3, 3, 3),
        (2, 2, 2),
        (3, 3, 3, 3),
        (3,) * 7,
        (4, 3, 2),
        (5, 4, 3, 3, 2, 2),
        (2,) * 10,
        (4,) * 5,
        (6, 4, 4, 3, 2, 2),
    ],
)
def test_on_a_fresh_database_pairs_are_covered_as_soon_as_the_covering_design_does(sizes):
    # Balance costs no coverage on these spaces: every pair is covered after as many
    # assignments as `harnesses --select` needs (analysis.design.cover), which does
    # not balance levels; 3^7 needs one fewer (15, cover 16).
    sp = space(*sizes)
    design = cover(sp, 200)
    n = 2 * design.covered_after
    result = assign(sp, tasks(n // 2), 2, [])
    assert result.uncovered == 0
    assert result.covered_after <= design.covered_after
    assert max(result.level_spread_after.values()) <= 1
    first = every_in_slot_order(result, n // 2)[: result.covered_after]
    assert not uncovered(sp, first)


def every_in_slot_order(result, n_tasks: int) -> list[dict]:
    """Round-robin: every task's first configuration, then every task's second."""
    return [result.configs[t][j] for j in range(2) for t in tasks(n_tasks)]


def test_a_second_run_fills_the_gaps_the_first_left():
    sp = space(3, 3, 3)
    first = assign(sp, tasks(2), 2, [])
    assert first.uncovered > 0  # 4 assignments cannot cover 27 pairs
    prior = [Prior(t, c) for t, cs in first.configs.items() for c in cs]
    second = assign(sp, tasks(4), 2, prior)
    assert second.prior == 4
    # Together they cover every pair after 6 new assignments (10 in all, where 9 is the
    # optimum for 3^3); starting over would need 9 new ones.
    assert second.uncovered == 0 and second.covered_after == 6
    assert assign(sp, tasks(5), 2, []).covered_after == 9
    assert not uncovered(sp, every(first) + every(second))
    # And the tasks that ran before meet configurations they had not met.
    for t in tasks(2):
        assert not {tuple(sorted(c.items())) for c in second.configs[t]} & {
            tuple(sorted(c.items())) for c in first.configs[t]
        }


def test_an_uneven_basis_is_evened_out_from_its_least_used_levels():
    sp = space(3)
    prior = [Prior("x", {"f0": "l0"})] * 5 + [Prior("y", {"f0": "l1"})]
    result = assign(sp, tasks(3), 1, prior)
    # l0 5, l1 1, l2 0: three new go to l2, l1, l2 (least used first).
    assert sorted(c["f0"] for c in every(result)) == ["l1", "l2", "l2"]
    assert result.level_spread_after == {"f0": 3}


def test_levels_keep_the_files_values_and_bad_counts_are_errors():
    sp = Space(
        {"retries": ["0", "3"], "temperature": ["0.5", "1"]},
        {"retries": [0, 3], "temperature": [0.5, 1]},
    )
    result = assign(sp, tasks(2), 2, [Prior("t0", {"retries": 0, "temperature": 0.5})])
    values = {(c["retries"], c["temperature"]) for c in every(result)}
    assert values <= {(0, 0.5), (0, 1), (3, 0.5), (3, 1)}
    assert result.prior == 1  # the basis's number 0 is the level "0"
    with pytest.raises(AnalysisError, match="only 4 configurations"):
        assign(sp, tasks(1), 5, [])
    with pytest.raises(AnalysisError, match="at least 1"):
        assign(sp, tasks(1), 0, [])


def test_when_balance_leaves_a_task_only_configs_it_has_the_bound_gives_way_not_distinctness():
    # Levels 0, 5, 5 before; one task, three configs: water-filling alone would give l0
    # three times. Distinct configs within the documented bound (the basis's spread, 5).
    sp = space(3)
    prior = [Prior("x", {"f0": "l1"})] * 5 + [Prior("x", {"f0": "l2"})] * 5
    result = assign(sp, tasks(1), 3, prior)
    assert sorted(c["f0"] for c in result.configs["t0"]) == ["l0", "l1", "l2"]
    assert result.level_spread_before == {"f0": 5} and result.level_spread_after == {"f0": 5}


@pytest.mark.parametrize(
    "sizes, n_tasks, per_task, prior",
    [
        # Found by Hypothesis: an early choice left one task only configurations it had.
        (
            (2, 1, 2),
            1,
            3,
            [("t0", ("l0", "l0", "l0")), ("t0", ("l1", "l0", "l0")), ("t0", ("l0", "l0", "l1"))],
        ),
        # Every task needs every level once, so l0 must get four more though it leads.
        ((4,), 4, 4, [("t0", ("l0",)), ("t0", ("l0",)), ("t1", ("l0",))]),
    ],
)
def test_distinct_configs_where_the_counts_barely_allow_them(sizes, n_tasks, per_task, prior):
    sp = space(*sizes)
    basis = [Prior(t, dict(zip(sp.factors, levels, strict=True))) for t, levels in prior]
    result = assign(sp, tasks(n_tasks), per_task, basis)
    for configs in result.configs.values():
        assert len({tuple(c.values()) for c in configs}) == per_task
    for f in sp.factors:
        assert result.level_spread_after[f] <= max(1, result.level_spread_before[f])
