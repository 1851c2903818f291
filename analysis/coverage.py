"""Harness-factor coverage: how often each factor level ran, how it did, which pairs never ran.

Levels come from the episodes' harness configs (analysis.episodes: a flat ``{factor:
level}`` object) and, with a factor space, from the space too, so a level or pair that
never ran shows up. Success per level with a Wilson 95% interval, mean reward with a
normal 95% interval (mean ± 1.96 standard errors).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence

import msgspec

from tracetap.analysis.design import Design, Space
from tracetap.analysis.episodes import AnalysisError, Episode
from tracetap.analysis.held_out import HeldOut
from tracetap.analysis.held_out import render as render_held_out
from tracetap.analysis.select import Success
from tracetap.analysis.stats import mean, mean_interval, wilson


class Level(msgspec.Struct, kw_only=True):
    factor: str
    level: str
    episodes: int
    success_rate: float | None
    success_interval: tuple[float, float] | None
    mean_reward: float | None
    reward_interval: tuple[float, float] | None


class Pair(msgspec.Struct, array_like=True):
    factor: str
    level: str
    other_factor: str
    other_level: str


class Coverage(msgspec.Struct, kw_only=True):
    episodes: int
    factors: list[str]
    unset: dict[str, int]  # episodes whose config lacks the factor
    levels: list[Level]
    pairs: int  # level pairs of different factors (observed levels, and the space's)
    unseen_pairs: list[Pair]
    design: Design | None = None
    held_out: HeldOut | None = None  # with --held-out: success there against the rest


def coverage(
    episodes: Sequence[Episode],
    *,
    success: Success,
    factors: Sequence[str] = (),
    space: Space | None = None,
) -> Coverage:
    if not episodes:
        raise AnalysisError("the filters select no episode")
    names = _factor_names(episodes, factors, space)
    levels = _levels(episodes, names, space)
    by_level: dict[tuple[str, str], list[Episode]] = defaultdict(list)
    for e in episodes:
        for f in names:
            if f in e.factors:
                by_level[(f, e.factors[f])].append(e)
    rows = [_level(f, v, by_level.get((f, v), []), success) for f in names for v in levels[f]]
    every = _every_pair(names, levels)
    seen_pairs = _seen_pairs(episodes, names)
    return Coverage(
        episodes=len(episodes),
        factors=names,
        unset={f: sum(f not in e.factors for e in episodes) for f in names},
        levels=rows,
        pairs=len(every),
        unseen_pairs=[Pair(*p) for p in every if p not in seen_pairs],
    )


def _factor_names(episodes: Sequence[Episode], factors: Sequence[str],
                  space: Space | None) -> list[str]:
    """The factors asked for, else the space's, else every one the episodes name."""
    names = list(factors) or (
        list(space.factors) if space else sorted({f for e in episodes for f in e.factors})
    )
    if not names:
        raise AnalysisError(
            f"none of the {len(episodes)} episodes has harness factors: "
            'register them with {"harness": {"config": {factor: level}}}'
        )
    return names


def _levels(episodes: Sequence[Episode], names: list[str],
            space: Space | None) -> dict[str, list[str]]:
    """Each factor's levels: the space's in its order, then the others seen, sorted."""
    levels: dict[str, list[str]] = {}
    for f in names:
        seen = sorted({e.factors[f] for e in episodes if f in e.factors})
        listed = space.factors.get(f, []) if space else []
        levels[f] = listed + [v for v in seen if v not in listed]
    return levels


def _every_pair(names: list[str], levels: dict[str, list[str]]) -> list[tuple]:
    """Every level pair of two different factors, in the factors' and levels' order."""
    return [
        (f, a, g, b)
        for f, g in itertools.combinations(names, 2)
        for a in levels[f]
        for b in levels[g]
    ]


def _seen_pairs(episodes: Sequence[Episode], names: list[str]) -> set[tuple]:
    return {
        (f, e.factors[f], g, e.factors[g])
        for e in episodes
        for f, g in itertools.combinations(names, 2)
        if f in e.factors and g in e.factors
    }


def _level(factor: str, value: str, episodes: list[Episode], success: Success) -> Level:
    wins = sum(success(e) for e in episodes)
    rewards = [e.summary.reward for e in episodes if e.summary.reward is not None]
    return Level(
        factor=factor,
        level=value,
        episodes=len(episodes),
        success_rate=wins / len(episodes) if episodes else None,
        success_interval=wilson(wins, len(episodes)) if episodes else None,
        mean_reward=mean(rewards) if rewards else None,
        reward_interval=mean_interval(rewards) if rewards else None,
    )


def render(c: Coverage, shown: int = 20) -> str:
    lines = [f"{c.episodes} episodes, factors: {', '.join(c.factors)}", ""]
    lines.append(
        f"{'factor':<16} {'level':<16} {'episodes':>8} {'success':>8} "
        f"{'95% interval':>15} {'reward':>7} {'95% interval':>17}"
    )
    for r in c.levels:
        rate = "-" if r.success_rate is None else f"{r.success_rate:.3f}"
        si = (
            ""
            if r.success_interval is None
            else (f"[{r.success_interval[0]:.2f}, {r.success_interval[1]:.2f}]")
        )
        reward = "-" if r.mean_reward is None else f"{r.mean_reward:.3f}"
        ri = (
            ""
            if r.reward_interval is None
            else (f"[{r.reward_interval[0]:.2f}, {r.reward_interval[1]:.2f}]")
        )
        lines.append(
            f"{r.factor[:16]:<16} {r.level[:16]:<16} {r.episodes:>8} {rate:>8} "
            f"{si:>15} {reward:>7} {ri:>17}"
        )
    unset = {f: n for f, n in c.unset.items() if n}
    if unset:
        lines.append(
            "configs without the factor: " + ", ".join(f"{f}: {n}" for f, n in unset.items())
        )
    lines.append("")
    lines.append(f"level pairs never run: {len(c.unseen_pairs)} of {c.pairs}")
    for p in c.unseen_pairs[:shown]:
        lines.append(f"  {p.factor}={p.level}  {p.other_factor}={p.other_level}")
    if len(c.unseen_pairs) > shown:
        lines.append(f"  ... and {len(c.unseen_pairs) - shown} more (--json lists them all)")
    if c.design is not None:
        lines += ["", *render_design(c.design)]
    if c.held_out is not None:
        lines += ["", *render_held_out(c.held_out)]
    return "\n".join(lines)


def render_design(d: Design) -> list[str]:
    reach = (
        f"all {d.pairs} pairs covered by the first {d.covered_after}"
        if d.covered_after
        else f"{d.uncovered} of {d.pairs} pairs left uncovered: ask for more"
    )
    lines = [
        f"proposed {len(d.configs)} configurations ({reach}; no design covers every "
        f"pair with fewer than {d.lower_bound}; each pair {d.pair_min}-{d.pair_max} "
        "times):"
    ]
    lines += ["  " + msgspec.json.encode(config).decode() for config in d.configs]
    return lines
