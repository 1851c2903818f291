"""``tracetap run --space``: slots whose configurations are assigned to the tasks
(analysis.assign) on top of what the proxy says this harness already ran.

The basis is read over the admin API (``GET /tracetap/harness-configs``) without this
run's own episodes and without anything registered after the first of them, so a rerun
of the same command line sees the basis the first run saw, assigns the same
configurations and finds its episodes by their ids."""

from __future__ import annotations

from typing import Any

import msgspec

from tracetap.analysis.assign import Assignment, Prior, assign
from tracetap.analysis.design import Space
from tracetap.analysis.episodes import AnalysisError
from tracetap.analysis.runner.admin import AdminClient
from tracetap.analysis.runner.plan import Slot, Task, safe
from tracetap.analysis.runner.template import fill


class SpaceReport(msgspec.Struct):
    """What the assignment promised and reached, for the summary."""

    configs_per_task: int
    prior_assignments: int  # of the basis, inside the space
    new_assignments: int
    pairs: int
    uncovered: int
    covered_after: int | None
    level_spread_before: dict[str, int]
    level_spread_after: dict[str, int]


async def space_slots(
    admin: AdminClient,
    space: Space,
    tasks: list[Task],
    *,
    per_task: int,
    repeats: int,
    group: str,
    run_id: str,
    harness_name: str,
) -> tuple[list[Slot], SpaceReport]:
    """The run's slots, round-robin: every task's first configuration (its repeats side
    by side), then every task's second, ...; the config index is the task's j-th."""
    if repeats < 1:
        raise ValueError("--repeats must be at least 1")
    basis = await admin.harness_configs(harness_name, f"{run_id}.")
    prior = [Prior(p.task_id, p.config) for p in basis.data if isinstance(p.config, dict)]
    try:
        assignment = assign(space, [t.id for t in tasks], per_task, prior)
    except AnalysisError as exc:  # bad input (status 2), like a bad --tasks
        raise ValueError(str(exc)) from None
    slots = []
    for j in range(per_task):
        for task in tasks:
            config = assignment.configs[task.id][j]
            values: dict[str, Any] = {
                "run_id": run_id,
                "task_id": task.id,
                "task": task.fields,
                "config": config,
            }
            group_id = safe(fill(group, values, "--group"), 128)
            for repeat in range(repeats):
                slots.append(Slot(run_id, task, j, config, repeat, group_id))
    return slots, _report(assignment, per_task)


def _report(a: Assignment, per_task: int) -> SpaceReport:
    return SpaceReport(
        configs_per_task=per_task,
        prior_assignments=a.prior,
        new_assignments=a.assignments,
        pairs=a.pairs,
        uncovered=a.uncovered,
        covered_after=a.covered_after,
        level_spread_before=a.level_spread_before,
        level_spread_after=a.level_spread_after,
    )


def render_report(r: SpaceReport) -> str:
    covered = (
        f"every pair covered after {r.covered_after} new assignments"
        if r.covered_after
        else "every pair was covered before this run"
        if r.covered_after == 0
        else f"{r.uncovered} pairs still uncovered (more tasks or --configs-per-task)"
    )
    spread = max(r.level_spread_after.values(), default=0)
    even = (
        "each factor's levels used equally often"
        if spread == 0
        else (f"each factor's level counts within {spread} of each other")
    )
    return (
        f"space: {r.pairs} level pairs, {r.prior_assignments} assignments already run; "
        f"{r.new_assignments} new ({r.configs_per_task} configs per task): {covered}; {even}"
    )


def space_identity(space: Space) -> dict[str, list[Any]]:
    """The space as the default run id hashes it (its factors and levels as written)."""
    return {f: (space.values or space.factors)[f] for f in space.factors}
