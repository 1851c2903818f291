"""Success on held-out harness configurations against the rest (``tracetap harnesses
--held-out``): the generalisation report of a factorised harness space.

Held out is what ``--held-out SELECTOR`` matches (``config.context=window``, any
selector of analysis.select; repeatable: an episode matching any of them) or a config
that ``--held-out-file`` lists (JSONL of flat ``{factor: level}`` objects, or one JSON
list of them: an episode is held out when its factors agree with every key of one of
them). Reported, each with a Wilson 95% interval:

- overall: held-out and rest success rates and their difference (held out minus rest)
  with Newcombe's hybrid score interval (his method 10, from the two Wilson intervals);
- per factor level: the same among the episodes at that level;
- per task that ran both: its held-out and rest rate (repeats averaged) and their
  difference d_t; then the mean of d_t with a paired bootstrap 95% interval
  (analysis.stats, seed 0, 2,000 resamples) and the sign test.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import msgspec

from tracetap.analysis.episodes import AnalysisError, Episode
from tracetap.analysis.select import Selector, Success
from tracetap.analysis.stats import bootstrap_interval, mean, sign_test, wilson
from tracetap.exporters.factors import factors_of

RESAMPLES = 2000


class Rate(msgspec.Struct, kw_only=True):
    episodes: int
    successes: int
    success_rate: float | None
    success_interval: tuple[float, float] | None


class Split(msgspec.Struct, kw_only=True):
    held_out: Rate
    rest: Rate
    difference: float | None  # held-out rate minus rest rate
    difference_interval: tuple[float, float] | None  # Newcombe's hybrid score, 95%


class LevelSplit(msgspec.Struct, kw_only=True):
    factor: str
    level: str
    split: Split


class TaskSplit(msgspec.Struct, kw_only=True):
    task_id: str
    held_out_episodes: int
    held_out_rate: float
    rest_episodes: int
    rest_rate: float
    difference: float


class HeldOut(msgspec.Struct, kw_only=True):
    selection: list[str]  # the selectors, and the file's configs as JSON
    overall: Split
    levels: list[LevelSplit]
    tasks: list[TaskSplit]  # tasks that ran both, by task id
    task_mean_difference: float | None
    task_difference_interval: tuple[float, float] | None  # paired bootstrap, 95%
    task_sign_test_p: float | None


class Chooser(msgspec.Struct, frozen=True):
    """Which episodes are held out."""

    selectors: tuple[Selector, ...] = ()
    configs: tuple[tuple[tuple[str, str], ...], ...] = ()  # (factor, level) terms each

    def __call__(self, e: Episode) -> bool:
        return any(s.matches(e) for s in self.selectors) or any(
            all(e.factors.get(f) == v for f, v in terms) for terms in self.configs
        )

    def describe(self) -> list[str]:
        return [s.text for s in self.selectors] + [
            msgspec.json.encode(dict(terms)).decode() for terms in self.configs
        ]


def read_configs(path: str | Path) -> tuple[tuple[tuple[str, str], ...], ...]:
    """A file of held-out configs: JSONL of objects, or one JSON list of objects."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise AnalysisError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        whole = msgspec.json.decode(text)
        items = whole if isinstance(whole, list) else [whole]
    except msgspec.DecodeError:
        items = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append(msgspec.json.decode(line))
                except msgspec.DecodeError as exc:
                    raise AnalysisError(f"{path}:{n}: not JSON: {exc}") from None
    out = []
    for n, item in enumerate(items, 1):
        factors = factors_of(item)
        if not isinstance(item, dict) or not factors:
            raise AnalysisError(
                f"{path}: config {n} is not a flat {{factor: level}} object: {item!r}"
            )
        out.append(tuple(factors.items()))
    if not out:
        raise AnalysisError(f"{path}: no configs")
    return tuple(out)


def held_out(
    episodes: Sequence[Episode],
    chooser: Chooser,
    *,
    success: Success,
    factors: list[str],
    levels: dict[str, list[str]],
) -> HeldOut:
    held = [e for e in episodes if chooser(e)]
    if not held:
        raise AnalysisError(f"no episode is held out by {', '.join(chooser.describe())}")
    if len(held) == len(episodes):
        raise AnalysisError("every episode is held out: nothing to compare with")
    marks = [(e, chooser(e), success(e)) for e in episodes]
    rows = []
    for f in factors:
        for v in levels[f]:
            at = [m for m in marks if m[0].factors.get(f) == v]
            rows.append(LevelSplit(factor=f, level=v, split=_split(at)))
    tasks = _tasks(marks)
    d = [t.difference for t in tasks]
    return HeldOut(
        selection=chooser.describe(),
        overall=_split(marks),
        levels=rows,
        tasks=tasks,
        task_mean_difference=mean(d) if d else None,
        task_difference_interval=(
            bootstrap_interval(d, resamples=RESAMPLES, seed=0) if d else None
        ),
        task_sign_test_p=sign_test(d) if d else None,
    )


def _rate(wins: list[bool]) -> Rate:
    n, k = len(wins), sum(wins)
    return Rate(
        episodes=n,
        successes=k,
        success_rate=k / n if n else None,
        success_interval=wilson(k, n) if n else None,
    )


def _split(marks: list[tuple[Episode, bool, bool]]) -> Split:
    held = _rate([won for _, out, won in marks if out])
    rest = _rate([won for _, out, won in marks if not out])
    if not (held.episodes and rest.episodes):
        return Split(held_out=held, rest=rest, difference=None, difference_interval=None)
    p1, p2 = held.success_rate, rest.success_rate
    (l1, u1), (l2, u2) = held.success_interval, rest.success_interval
    d = p1 - p2
    interval = (
        d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2),
        d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2),
    )
    return Split(held_out=held, rest=rest, difference=d, difference_interval=interval)


def _tasks(marks: list[tuple[Episode, bool, bool]]) -> list[TaskSplit]:
    by_task: dict[str, tuple[list[bool], list[bool]]] = defaultdict(lambda: ([], []))
    for e, out, won in marks:
        if e.task is not None:
            by_task[e.task][0 if out else 1].append(won)
    rows = []
    for task in sorted(by_task):
        held, rest = by_task[task]
        if held and rest:
            h, r = sum(held) / len(held), sum(rest) / len(rest)
            rows.append(
                TaskSplit(
                    task_id=task,
                    held_out_episodes=len(held),
                    held_out_rate=h,
                    rest_episodes=len(rest),
                    rest_rate=r,
                    difference=h - r,
                )
            )
    return rows


def render(h: HeldOut) -> list[str]:
    def rate(r: Rate) -> str:
        if r.success_rate is None:
            return f"{'-':>8} {'':>15}"
        lo, hi = r.success_interval
        return f"{r.success_rate:>8.3f} {f'[{lo:.2f}, {hi:.2f}]':>15}"

    def diff(s: Split) -> str:
        if s.difference is None:
            return ""
        lo, hi = s.difference_interval
        return f"{s.difference:+.3f} [{lo:+.2f}, {hi:+.2f}]"

    head = (
        f"{'':<33} {'held':>5} {'success':>8} {'95% interval':>15} "
        f"{'rest':>5} {'success':>8} {'95% interval':>15}  difference"
    )
    lines = [f"held out: {'; '.join(h.selection)}", head]

    def row(name: str, s: Split) -> str:
        return (
            f"{name[:33]:<33} {s.held_out.episodes:>5} {rate(s.held_out)} "
            f"{s.rest.episodes:>5} {rate(s.rest)}  {diff(s)}"
        )

    lines.append(row("all", h.overall))
    lines += [row(f"{r.factor}={r.level}", r.split) for r in h.levels]
    if h.tasks:
        lo, hi = h.task_difference_interval
        p = "-" if h.task_sign_test_p is None else f"{h.task_sign_test_p:.3g}"
        lines.append(
            f"tasks that ran both: {len(h.tasks)}; mean held-out minus rest "
            f"{h.task_mean_difference:+.3f} [{lo:+.2f}, {hi:+.2f}] (paired bootstrap), "
            f"sign test p = {p}"
        )
    else:
        lines.append("no task ran both held-out and other configs")
    return lines
