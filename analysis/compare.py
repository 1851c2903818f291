"""Δ_B: harness variants compared on the same task batch.

Episodes are paired by task: each variant's repeats of a task are averaged first, so a
task counts once whatever its number of repeats. For a candidate against the baseline,
on the tasks both ran: d_t = success rate of the candidate on t - that of the baseline,
Δ_B = mean of d_t, with a paired bootstrap percentile interval over tasks and an exact
sign-test p-value over the tasks where d_t != 0 (analysis.stats). A task is fixed when
d_t > 0, broken when d_t < 0, unchanged otherwise. Costs are per episode: usage tokens
(prompt + completion summed over the calls: a resent history counts at each call),
trajectory tokens (the longest call's prompt + completion) and model latency (the sum of
the calls' durations), their differences paired by task the same way. A variant's own
figures are over all its episodes; the differences over the paired tasks, each task once:
``paired`` holds both sides' means there, whose difference each one is.

Held out: given the tasks a patch was written from (``seen_tasks``: the failure packets'
tasks), the same Δ_B, interval and sign test on the paired tasks outside them: the figure
that says whether a patch generalises rather than fits the failures it was shown.

Advantages, as the trainer computes them: each candidate's reward (its in-batch or its
held-out Δ_B, ``reward``), and each invalid candidate (a patch that never ran: it did not
load, failed on its packet, broke the guard set) with ``penalty``, form one group; with
K >= 2 in it, each one's advantage is (reward - mean) / std over the K (population std, as
GRPO; 0 when all are equal). [0.375, 0, -1] gives [+1.005, +0.359, -1.364].
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import msgspec

from tracetap.analysis.episodes import AnalysisError, Episode
from tracetap.analysis.integrity import clean_variant
from tracetap.analysis.select import Selector, Success
from tracetap.analysis.stats import bootstrap_interval, mean, normalised, sign_test


class Variant(msgspec.Struct, kw_only=True):
    selector: str
    episodes: int
    tasks: int
    success_rate: float
    mean_reward: float | None
    tokens_per_episode: float  # usage: prompt + completion summed over the calls
    latency_per_episode: float  # seconds
    trajectory_tokens_per_episode: float = 0.0
    # Episodes of this selection left out because their integrity is infra (not in Δ_B).
    infra_excluded: int = 0


class Flips(msgspec.Struct, kw_only=True):
    fixed: list[str]
    broken: list[str]
    unchanged: int


class Means(msgspec.Struct, kw_only=True):
    """One side over the paired tasks, each task's repeats averaged first."""

    success: float
    tokens: float
    trajectory_tokens: float
    latency: float


class Candidate(msgspec.Struct, kw_only=True):
    variant: Variant
    paired_tasks: int
    unpaired_tasks: list[str]  # dropped (--allow-unpaired): ran by only one of the two
    delta: float  # Δ_B
    interval: tuple[float, float]
    p_value: float | None  # None: no task changed
    reward_delta: float | None
    flips: Flips
    tokens_delta: float  # per episode, candidate - baseline
    latency_delta: float
    advantage: float | None = None  # with K >= 2 candidates
    held_out: HeldOut | None = None  # with seen_tasks
    reward: float | None = None  # what the group's advantage used
    paired: tuple[Means, Means] | None = None  # baseline, candidate: the deltas are b - a


class HeldOut(msgspec.Struct, kw_only=True):
    """Δ_B on the paired tasks outside the ones the patch was written from."""

    tasks: int
    delta: float | None  # None: no such task
    interval: tuple[float, float] | None
    p_value: float | None


class Invalid(msgspec.Struct, kw_only=True):
    """A candidate that never ran: in the group with the penalty."""

    label: str
    reward: float
    advantage: float | None = None


class Comparison(msgspec.Struct, kw_only=True):
    baseline: Variant
    candidates: list[Candidate]
    success: Success
    resamples: int
    seed: int
    invalid: list[Invalid] = []
    reward: str = "in-batch"  # which Δ_B the advantages used: in-batch or held-out


class _Tasks(msgspec.Struct):
    """Per task: the means over its repeats."""

    success: dict[str, float]
    reward: dict[str, float]
    tokens: dict[str, float]
    latency: dict[str, float]
    trajectory: dict[str, float]


def compare(
    episodes: Sequence[Episode],
    baseline: Selector,
    candidates: Sequence[Selector],
    *,
    success: Success,
    resamples: int = 2000,
    seed: int = 0,
    allow_unpaired: bool = False,
    seen_tasks: frozenset[str] = frozenset(),
    invalid: Sequence[str] = (),
    penalty: float = -1.0,
    reward: str | None = None,
) -> Comparison:
    """``reward``: "in-batch" or "held-out"; None: held-out when ``seen_tasks`` leave
    every candidate a held-out task, else in-batch."""
    if not candidates:
        raise AnalysisError("give at least one --candidate selection")
    if resamples < 1:
        raise AnalysisError("--resamples must be at least 1")
    base_all = _chosen(episodes, baseline, "baseline")
    base_eps, base_infra = clean_variant(base_all, baseline.text)
    base, base_tasks = _variant(base_eps, baseline, success)
    base.infra_excluded = base_infra
    results = []
    for selector in candidates:
        chosen = _chosen(episodes, selector, "candidate")
        both = {e.id for e in base_all} & {e.id for e in chosen}
        if both:
            raise AnalysisError(
                f"{len(both)} episodes match both the baseline "
                f"{baseline.text!r} and the candidate {selector.text!r} "
                f"(e.g. {min(both)}): the selections must not overlap"
            )
        chosen, infra = clean_variant(chosen, selector.text)
        variant, tasks = _variant(chosen, selector, success)
        variant.infra_excluded = infra
        result = _against(
            variant, tasks, base_tasks, selector, baseline, resamples, seed, allow_unpaired
        )
        if seen_tasks:
            result.held_out = _held_out(tasks, base_tasks, seen_tasks, resamples, seed)
        results.append(result)
    which = _which(reward, results, seen_tasks)
    group = [Invalid(label=label, reward=penalty) for label in invalid]
    for result in results:
        result.reward = result.delta if which == "in-batch" else result.held_out.delta
    rewards = [r.reward for r in results] + [g.reward for g in group]
    if len(rewards) >= 2 and None not in rewards:
        for member, advantage in zip([*results, *group], normalised(rewards)):
            member.advantage = advantage
    return Comparison(
        baseline=base, candidates=results, success=success, resamples=resamples, seed=seed,
        invalid=group, reward=which,
    )


def _which(reward: str | None, results: list[Candidate], seen: frozenset[str]) -> str:
    if reward not in (None, "in-batch", "held-out"):
        raise AnalysisError("--reward is in-batch or held-out")
    allows = bool(seen) and all(r.held_out and r.held_out.tasks for r in results)
    if reward == "held-out" and not allows:
        raise AnalysisError(
            "--reward held-out needs --seen-task and, for every candidate, a paired task "
            "outside them"
        )
    return reward or ("held-out" if allows else "in-batch")


def _held_out(
    tasks: _Tasks, base: _Tasks, seen: frozenset[str], resamples: int, seed: int
) -> HeldOut:
    outside = sorted((tasks.success.keys() & base.success.keys()) - seen)
    if not outside:
        return HeldOut(tasks=0, delta=None, interval=None, p_value=None)
    d = [tasks.success[t] - base.success[t] for t in outside]
    return HeldOut(
        tasks=len(outside),
        delta=mean(d),
        interval=bootstrap_interval(d, resamples=resamples, seed=seed),
        p_value=sign_test(d),
    )


def _chosen(episodes: Sequence[Episode], selector: Selector, role: str) -> list[Episode]:
    chosen = [e for e in episodes if selector.matches(e)]
    if not chosen:
        raise AnalysisError(
            f"the {role} selection {selector.text!r} matches none of the "
            f"{len(episodes)} episodes the filters select"
        )
    untasked = [e.id for e in chosen if e.task is None]
    if untasked:
        raise AnalysisError(
            f"{len(untasked)} episodes of {selector.text!r} have no task_id "
            f"(e.g. {untasked[0]}): Δ_B pairs episodes by task; register "
            "them with task_id or narrow the selection"
        )
    return chosen


def _variant(
    episodes: list[Episode], selector: Selector, success: Success
) -> tuple[Variant, _Tasks]:
    by_task: dict[str, list[Episode]] = defaultdict(list)
    for e in episodes:
        by_task[e.task].append(e)
    rewards = [e.summary.reward for e in episodes if e.summary.reward is not None]
    def per_task(value) -> dict[str, float]:
        return {t: mean([value(e) for e in es]) for t, es in by_task.items()}

    tasks = _Tasks(
        success=per_task(lambda e: float(success(e))),
        reward={
            t: mean(r)
            for t, es in by_task.items()
            if (r := [e.summary.reward for e in es if e.summary.reward is not None])
        },
        tokens=per_task(_tokens),
        latency=per_task(lambda e: e.summary.latency),
        trajectory=per_task(_trajectory),
    )
    variant = Variant(
        selector=selector.text,
        episodes=len(episodes),
        tasks=len(by_task),
        success_rate=mean([float(success(e)) for e in episodes]),
        mean_reward=mean(rewards) if rewards else None,
        tokens_per_episode=mean([_tokens(e) for e in episodes]),
        latency_per_episode=mean([e.summary.latency for e in episodes]),
        trajectory_tokens_per_episode=mean([_trajectory(e) for e in episodes]),
    )
    return variant, tasks


def _against(
    variant: Variant,
    tasks: _Tasks,
    base: _Tasks,
    selector: Selector,
    baseline: Selector,
    resamples: int,
    seed: int,
    allow_unpaired: bool,
) -> Candidate:
    paired = sorted(tasks.success.keys() & base.success.keys())
    only_base = sorted(base.success.keys() - tasks.success.keys())
    only_cand = sorted(tasks.success.keys() - base.success.keys())
    if not paired:
        raise AnalysisError(
            f"the baseline {baseline.text!r} and the candidate "
            f"{selector.text!r} share no task: Δ_B compares the same tasks"
        )
    if (only_base or only_cand) and not allow_unpaired:
        raise AnalysisError(
            f"{len(only_base) + len(only_cand)} tasks ran under only one of the baseline "
            f"{baseline.text!r} and the candidate {selector.text!r} (baseline only: "
            f"{_few(only_base)}; candidate only: {_few(only_cand)}); Δ_B compares the same "
            "tasks: narrow the selections or pass --allow-unpaired to drop them"
        )
    d = [tasks.success[t] - base.success[t] for t in paired]
    rewarded = [t for t in paired if t in tasks.reward and t in base.reward]
    return Candidate(
        variant=variant,
        paired_tasks=len(paired),
        unpaired_tasks=only_base + only_cand,
        delta=mean(d),
        interval=bootstrap_interval(d, resamples=resamples, seed=seed),
        p_value=sign_test(d),
        reward_delta=mean([tasks.reward[t] - base.reward[t] for t in rewarded])
        if rewarded
        else None,
        flips=Flips(
            fixed=[t for t, x in zip(paired, d) if x > 0],
            broken=[t for t, x in zip(paired, d) if x < 0],
            unchanged=sum(x == 0 for x in d),
        ),
        tokens_delta=mean([tasks.tokens[t] - base.tokens[t] for t in paired]),
        latency_delta=mean([tasks.latency[t] - base.latency[t] for t in paired]),
        paired=(_means(base, paired), _means(tasks, paired)),
    )


def _means(tasks: _Tasks, paired: list[str]) -> Means:
    return Means(success=mean([tasks.success[t] for t in paired]),
                 tokens=mean([tasks.tokens[t] for t in paired]),
                 trajectory_tokens=mean([tasks.trajectory[t] for t in paired]),
                 latency=mean([tasks.latency[t] for t in paired]))


def _tokens(e: Episode) -> float:
    return float(e.summary.prompt_tokens + e.summary.completion_tokens)


def _trajectory(e: Episode) -> float:
    return float(e.summary.context_tokens)


def _few(names: list[str], shown: int = 3) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def render(c: Comparison) -> str:
    """The comparison as a table for people."""
    s = c.success
    lines = [
        f"success: outcome in {{{', '.join(s.outcomes)}}}, else reward >= "
        f"{s.threshold:g}; paired bootstrap {c.resamples} resamples, seed {c.seed}",
        "",
    ]
    header = (
        f"{'variant':<28} {'episodes':>8} {'tasks':>6} {'success':>8} {'reward':>7} "
        f"{'traj tok/ep':>11} {'usage/ep':>10} {'latency/ep':>10}"
    )
    lines.append(header)
    for v in [c.baseline, *(x.variant for x in c.candidates)]:
        reward = "-" if v.mean_reward is None else f"{v.mean_reward:.3f}"
        lines.append(
            f"{v.selector[:28]:<28} {v.episodes:>8} {v.tasks:>6} "
            f"{v.success_rate:>8.3f} {reward:>7} {v.trajectory_tokens_per_episode:>11.1f} "
            f"{v.tokens_per_episode:>10.1f} "
            f"{v.latency_per_episode:>9.3f}s"
        )
    infra = [v for v in [c.baseline, *(x.variant for x in c.candidates)] if v.infra_excluded]
    for v in infra:
        lines.append(f"left out of {v.selector!r}: {v.infra_excluded} episodes with "
                     "integrity infra (not the harness's doing)")
    lines += ["", f"against the baseline {c.baseline.selector!r}:"]
    header = (
        f"{'candidate':<28} {'tasks':>6} {'Δ_B':>7} {'95% interval':>17} "
        f"{'sign p':>7} {'fixed':>5} {'broken':>6} {'same':>5} {'Δusage':>9} "
        f"{'Δlatency':>9} {'advantage':>9}"
    )
    lines.append(header)
    for x in c.candidates:
        p = "-" if x.p_value is None else f"{x.p_value:.3g}"
        adv = "-" if x.advantage is None else f"{x.advantage:+.3f}"
        interval = f"[{x.interval[0]:+.3f}, {x.interval[1]:+.3f}]"
        lines.append(
            f"{x.variant.selector[:28]:<28} {x.paired_tasks:>6} {x.delta:>+7.3f} "
            f"{interval:>17} {p:>7} {len(x.flips.fixed):>5} "
            f"{len(x.flips.broken):>6} {x.flips.unchanged:>5} "
            f"{x.tokens_delta:>+9.1f} {x.latency_delta:>+8.3f}s {adv:>9}"
        )
        if x.held_out is not None:
            lines.append(f"  {_held(x.held_out)}")
        if x.unpaired_tasks:
            lines.append(
                f"  dropped {len(x.unpaired_tasks)} unpaired tasks: {_few(x.unpaired_tasks)}"
            )
    for g in c.invalid:
        adv = "-" if g.advantage is None else f"{g.advantage:+.3f}"
        said = f"invalid: in the group with the penalty {g.reward:+g}"
        lines.append(f"{g.label[:28]:<28} {said:<{len(header) - 39}} {adv:>9}")
    if c.candidates and c.candidates[0].advantage is not None:
        lines.append(f"(advantages: the {c.reward} Δ_B of each candidate, the penalty of "
                     "each invalid one, normalised over the group, population std)")
    return "\n".join(lines)


def _held(h: HeldOut) -> str:
    if h.delta is None or h.interval is None:
        return "held out: no paired task outside the ones the patch was written from"
    p = "-" if h.p_value is None else f"{h.p_value:.3g}"
    return (f"held out ({h.tasks} tasks not in its packets): Δ_B {h.delta:+.3f} "
            f"[{h.interval[0]:+.3f}, {h.interval[1]:+.3f}], sign p {p}")
