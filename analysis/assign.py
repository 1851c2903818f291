"""Harness configurations assigned to tasks (``tracetap run --space``), building on what
already ran: each task meets ``per_task`` different configurations, every pair of factor
levels is covered as early as the assignments allow, and each factor's level counts stay
balanced.

The unit is an *assignment*: one (task, configuration), however many repeats or attempts
it has. The basis is the assignments that already ran (analysis.runner.space_plan asks
the proxy); the new ones are chosen one at a time, round-robin over the tasks (every
task's first configuration, then every task's second, ...), so a run cut short still has
every task at a spread of levels.

What holds (tests/test_assign.py, with Hypothesis):

- **Balance.** Before the first new assignment, each factor's end counts are fixed:
  the new assignments water-filled onto the basis's counts from the least-used levels up
  (ties: the level given fewest new ones, then the first listed; none aimed at more new
  ones than the tasks' distinct configurations can hold). Each new assignment
  takes only levels still short of their target, so at the end each factor's level
  counts, basis included, differ by at most max(1, their spread in the basis): within one
  on a fresh database, and an uneven basis is evened out from its least-used levels up.
- **Distinct.** A task's new configurations differ from each other; ``per_task`` may not
  exceed the configurations the space holds.
- **Coverage.** Among the configurations the targets allow, the one completing most
  least-covered pairs wins (ties: the task's least-met levels, then the smallest sum of
  squared pair counts); on a fresh database, the rows of a known optimal construction
  (analysis.design.constructed) come first when the run has room for them all.
  ``Assignment.covered_after`` says how many new assignments it took to cover every pair,
  ``uncovered`` what is still missing.

When the targets allow only configurations the task already has, the new one goes to
an earlier slot of another task that lacks it, and that slot's configuration comes to
this task: the same counts, every task's configurations still distinct. With no such
slot (one task, say), a target moves from one level to another where the bound above
still holds (``_State.retarget``); only when none can is it an error. Choices that would
leave a task too few configurations it lacks are avoided where another will do
(``_room``).
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import msgspec

from tracetap.analysis.design import Space, constructed
from tracetap.analysis.episodes import AnalysisError
from tracetap.exporters.factors import factors_of

_EXHAUSTIVE = 256  # allowed configurations scored one by one up to this many
_STARTS = 16  # least-covered pairs tried as starts above it

Config = tuple[str, ...]  # one level (as text) per factor, in the space's order


class Prior(msgspec.Struct, frozen=True):
    """An assignment that already ran: a task and its harness config (decoded JSON)."""

    task_id: str | None
    config: dict[str, Any]


class Assignment(msgspec.Struct, kw_only=True):
    configs: dict[str, list[dict[str, Any]]]  # task id -> its new configs, in slot order
    assignments: int  # new assignments (tasks x per_task)
    prior: int  # assignments of the basis inside the space
    pairs: int  # factor-level pairs in the space
    uncovered: int  # pairs in neither the basis nor the new assignments
    covered_after: int | None  # new assignments after which every pair was covered
    level_spread_before: dict[str, int]  # per factor: most-used minus least-used level
    level_spread_after: dict[str, int]
    swaps: int  # times balance moved a configuration to another task's slot


class _State:
    """Counts over basis and new assignments, as the greedy choice reads them."""

    def __init__(self, space: Space, tasks: list[str], prior: list[Prior]):
        self.names = list(space.factors)
        self.levels = [space.factors[f] for f in self.names]
        self.used = [dict.fromkeys(levels, 0) for levels in self.levels]
        self.pairs: dict[tuple[int, str, int, str], int] = {}
        for i, j in itertools.combinations(range(len(self.names)), 2):
            for a in self.levels[i]:
                for b in self.levels[j]:
                    self.pairs[(i, a, j, b)] = 0
        self.met = {t: [dict.fromkeys(lv, 0) for lv in self.levels] for t in tasks}
        self.seen: dict[str, set[Config]] = {t: set() for t in tasks}
        self.prior = 0
        for p in prior:
            config = self.inside(p.config)
            if config is None:
                continue
            self.prior += 1
            self.add(config)
            if p.task_id in self.met:
                self.seen[p.task_id].add(config)
                self.mark(p.task_id, config, 1)

    def inside(self, config: dict[str, Any]) -> Config | None:
        """The config as a point of the space; None when a factor is missing or off it."""
        factors = factors_of(config)
        out = []
        for name, levels in zip(self.names, self.levels, strict=True):
            if factors.get(name) not in levels:
                return None
            out.append(factors[name])
        return tuple(out)

    def add(self, c: Config, by: int = 1) -> None:
        for i, v in enumerate(c):
            self.used[i][v] += by
        for i, j in itertools.combinations(range(len(c)), 2):
            self.pairs[(i, c[i], j, c[j])] += by

    def mark(self, task: str, c: Config, by: int) -> None:
        for i, v in enumerate(c):
            self.met[task][i][v] += by

    def aim(self, new: int, caps: list[dict[str, int]]) -> None:
        """Each level's count at the end: ``new`` more assignments water-filled from the
        least-used levels up (ties: the level given fewest new ones, then the first
        listed), none past its cap (the most new assignments distinct configurations per
        task can give it); the end counts differ by at most max(1, the spread now)."""
        self.target = []
        self.bound = [max(1, max(c.values()) - min(c.values())) for c in self.used]
        for counts, cap in zip(self.used, caps, strict=True):
            end, given = dict(counts), dict.fromkeys(counts, 0)
            for _ in range(new):
                # Of the least used, the one given fewest new assignments, then the first
                # listed: new assignments spread over the levels, so a task can meet
                # different ones.
                room = [v for v in end if given[v] < cap[v]] or list(end)
                least = min(room, key=lambda v: (end[v], given[v]))
                end[least] += 1
                given[least] += 1
            self.target.append(end)

    def retarget(self, c: Config) -> bool:
        """Make room for ``c`` when balance's targets leave a task only configurations
        it has: each level of ``c`` without room takes one from a level with room, if
        the targets then still differ by at most the bound. Whether it could."""
        moves = []
        for i, v in enumerate(c):
            end, used = self.target[i], self.used[i]
            if used[v] < end[v]:
                continue
            for u in sorted(end, key=lambda u: (-(end[u] - used[u]), self.levels[i].index(u))):
                if end[u] > used[u] and u != v:
                    trial = dict(end, **{v: end[v] + 1, u: end[u] - 1})
                    if max(trial.values()) - min(trial.values()) <= self.bound[i]:
                        moves.append((i, trial))
                        break
            else:
                return False
        for i, trial in moves:
            self.target[i] = trial
        return True

    def allowed(self) -> list[list[str]]:
        """Per factor, the levels still short of their target."""
        return [
            [v for v, n in counts.items() if n < end[v]]
            for counts, end in zip(self.used, self.target, strict=True)
        ]

    def low(self) -> int:
        return min(self.pairs.values(), default=0)

    def spread(self) -> dict[str, int]:
        return {
            f: max(c.values()) - min(c.values()) for f, c in zip(self.names, self.used, strict=True)
        }

    def covered(self) -> bool:
        if self.pairs:
            return self.low() > 0
        return all(min(c.values()) > 0 for c in self.used)  # one factor: every level once

    def score(self, task: str, c: Config, low: int) -> tuple[int, int, int]:
        new = squares = 0
        for i, j in itertools.combinations(range(len(c)), 2):
            n = self.pairs[(i, c[i], j, c[j])]
            new += n == low
            squares += n * n
        met = sum(self.met[task][i][v] for i, v in enumerate(c))
        return (new, -met, -squares)


def assign(space: Space, tasks: list[str], per_task: int, prior: list[Prior]) -> Assignment:
    """``per_task`` configurations for each task (in the tasks' order), on top of
    ``prior``; deterministic: the same inputs give the same assignment."""
    size = _space_size(space, per_task)
    state = _State(space, tasks, prior)
    before = state.spread()
    seeds = _aim_with_seeds(space, state, len(tasks), per_task, size)
    rng = random.Random(0)  # fixed: the same inputs give the same assignment
    slots: list[tuple[str, Config]] = []
    has: dict[str, set[Config]] = {t: set() for t in tasks}
    covered_after = 0 if state.covered() else None
    swaps = 0
    for _ in range(per_task):
        for task in tasks:
            if len(slots) < len(seeds):  # distinct rows, one per task in a round
                chosen = seeds[len(slots)]
            else:
                chosen = _choose(state, task, has[task], per_task - len(has[task]) - 1, rng)
            given = chosen
            if chosen in has[task]:  # counts take `chosen`; another task's slot holds it
                given = _swap(state, slots, has, task, chosen)
                if given is None:
                    chosen = given = _relaxed(state, task, has[task])
                else:
                    swaps += 1
            slots.append((task, given))
            has[task].add(given)
            state.add(chosen)
            state.mark(task, given, 1)
            if covered_after is None and state.covered():
                covered_after = len(slots)
    return Assignment(
        configs=_configs(space, state, tasks, slots),
        assignments=len(slots),
        prior=state.prior,
        pairs=len(state.pairs),
        uncovered=sum(n == 0 for n in state.pairs.values()),
        covered_after=covered_after,
        level_spread_before=before,
        level_spread_after=state.spread(),
        swaps=swaps,
    )


def _space_size(space: Space, per_task: int) -> int:
    """How many configurations the space holds; an error when ``per_task`` is below one
    or above that (a task's configurations are distinct)."""
    if per_task < 1:
        raise AnalysisError("--configs-per-task must be at least 1")
    size = 1
    for levels in space.factors.values():
        size *= len(levels)
    if per_task > size:
        raise AnalysisError(
            f"--configs-per-task {per_task}: the space holds only {size} configurations"
        )
    return size


def _aim_with_seeds(space: Space, state: _State, tasks: int, per_task: int,
                    size: int) -> list[Config]:
    """The seed rows (``_seeds``), with balance's targets set so that they fit: the seeds
    are counted while the targets are aimed, then taken out again to be added as their
    slots come."""
    seeds = _seeds(space, state, tasks * per_task)
    for c in seeds:  # counted up front, so the targets make room for them
        state.add(c)
    # A level can be in at most size / levels of a task's distinct configurations.
    caps = [
        {v: tasks * (size // len(levels)) - sum(c[i] == v for c in seeds) for v in levels}
        for i, levels in enumerate(state.levels)
    ]
    state.aim(tasks * per_task - len(seeds), caps)
    for c in seeds:  # added again as their slots come
        state.add(c, -1)
    return seeds


def _configs(space: Space, state: _State, tasks: list[str],
             slots: list[tuple[str, Config]]) -> dict[str, list[dict[str, Any]]]:
    """Each task's new configurations, in slot order, as harness config values."""
    out: dict[str, list[dict[str, Any]]] = {t: [] for t in tasks}
    for task, config in slots:
        out[task].append({f: space.value(f, v) for f, v in zip(state.names, config, strict=True)})
    return out


def _seeds(space: Space, state: _State, new: int) -> list[Config]:
    """The rows of a known optimal construction (analysis.design.constructed) when the
    basis holds nothing of the space and the run has room for all of them; else none."""
    if state.prior:
        return []
    rows = constructed(space)
    if rows is None or len(rows) > new:
        return []
    return [tuple(row[f] for f in state.names) for row in rows]


def _choose(state: _State, task: str, has: set[Config], left: int, rng: random.Random) -> Config:
    """The best configuration balance allows, one the task lacks when there is one, and
    one after which the targets still leave room for the task's ``left`` more."""
    allowed = state.allowed()
    low = state.low()
    total = 1
    for levels in allowed:
        total *= len(levels)
    if total <= _EXHAUSTIVE:
        candidates = list(itertools.product(*allowed))
    else:
        candidates = _starts(state, task, allowed, low, rng)
    best, best_key = None, None
    for c in candidates:
        key = (c not in has, _room(state, c, has, left), state.score(task, c, low))
        if best_key is None or key > best_key:
            best, best_key = c, key
    if best in has and total > _EXHAUSTIVE:  # sampled only: look for one it lacks
        for c in itertools.product(*allowed):
            if c not in has:
                return c
    return best


def _room(state: _State, c: Config, has: set[Config], left: int) -> bool:
    """Whether, once ``c`` is taken, the levels still short of their targets make at
    least ``left`` configurations the task lacks (a necessary condition for giving it
    ``left`` more distinct ones: with few tasks, an early choice can leave none)."""
    if left <= 0:
        return True
    open_ = [
        {v for v, n in used.items() if end[v] - n - (v == c[i]) > 0}
        for i, (used, end) in enumerate(zip(state.used, state.target, strict=True))
    ]
    size = 1
    for levels in open_:
        size *= len(levels)
    inside = sum(all(x[i] in open_[i] for i in range(len(x))) for x in (*has, c))
    return size - inside >= left


def _starts(
    state: _State, task: str, allowed: list[list[str]], low: int, rng: random.Random
) -> list[Config]:
    """AETG-style candidates: each from a least-covered allowed pair, the other factors
    filled in a shuffled order with the level completing most least-covered pairs."""
    ok = [set(levels) for levels in allowed]
    starts = [
        p for p, n in state.pairs.items() if n == low and p[1] in ok[p[0]] and p[3] in ok[p[2]]
    ][:_STARTS] or [None]
    out = []
    for start in starts:
        chosen: dict[int, str] = {} if start is None else {start[0]: start[1], start[2]: start[3]}
        for i in rng.sample(range(len(allowed)), len(allowed)):
            if i in chosen:
                continue
            best, best_key = None, None
            for v in allowed[i]:
                new = squares = 0
                for j, w in chosen.items():
                    n = state.pairs[(i, v, j, w) if i < j else (j, w, i, v)]
                    new += n == low
                    squares += n * n
                key = (-new, state.met[task][i][v], squares)
                if best_key is None or key < best_key:
                    best, best_key = v, key
            chosen[i] = best
        out.append(tuple(chosen[i] for i in range(len(allowed))))
    return out


def _swap(
    state: _State,
    slots: list[tuple[str, Config]],
    has: dict[str, set[Config]],
    task: str,
    config: Config,
) -> Config | None:
    """``config`` (which ``task`` has) given to the latest earlier slot of a task that
    lacks it; that slot's configuration, which ``task`` lacks, is what ``task`` gets
    (None: no slot can)."""
    for index in range(len(slots) - 1, -1, -1):
        other, theirs = slots[index]
        if other != task and config not in has[other] and theirs not in has[task]:
            slots[index] = (other, config)
            has[other].discard(theirs)
            has[other].add(config)
            state.mark(other, theirs, -1)
            state.mark(other, config, 1)
            return theirs
    return None


def _relaxed(state: _State, task: str, has: set[Config]) -> Config:
    """The best configuration the task lacks that the targets can make room for."""
    low = state.low()
    lacking = [c for c in itertools.product(*state.levels) if c not in has]
    lacking.sort(key=lambda c: state.score(task, c, low), reverse=True)
    for c in lacking:
        if state.retarget(c):
            return c
    raise AnalysisError(
        "cannot give every task distinct configurations with level counts balanced: "
        "use a smaller --configs-per-task or more tasks"
    )
