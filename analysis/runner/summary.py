"""The end of a run: how many episodes ran, were skipped, failed, timed out; the mean
reward per harness config. A table for people, JSON for scripts."""

from __future__ import annotations

from typing import Any

import msgspec

from tracetap.analysis.runner.episode import RAN, SKIPPED, Result
from tracetap.analysis.runner.outcomes import FAILURE, GRADER_ERROR, SUCCESS, TIMEOUT
from tracetap.analysis.runner.plan import digest
from tracetap.analysis.runner.space_plan import SpaceReport


class ConfigSummary(msgspec.Struct):
    config: dict[str, Any]
    episodes: int = 0
    rewarded: int = 0  # episodes with a reward (mean_reward is over these)
    mean_reward: float | None = None
    successes: int = 0  # outcome success


class Summary(msgspec.Struct):
    run_id: str
    episodes: int
    ran: int
    skipped: int
    failed: int  # outcome failure (no grader: a non-zero exit)
    timeout: int
    grader_error: int
    interrupted: int  # slots run again because an earlier run was stopped in them
    configs: list[ConfigSummary]
    elapsed_s: float
    space: SpaceReport | None = None  # with --space: the assignment's coverage and balance


def summarise(
    run_id: str,
    configs: list[dict[str, Any]],
    results: list[Result],
    elapsed: float,
    *,
    by_value: bool = False,
) -> Summary:
    """``by_value``: find each result's config by its value (with --space a slot's index
    is its task's j-th config), not by the slot's index into ``configs``."""
    per = [ConfigSummary(c) for c in configs]
    sums = [0.0] * len(configs)
    index = {digest(c): i for i, c in reversed(list(enumerate(configs)))}
    for r in results:
        i = index[digest(r.slot.config)] if by_value else r.slot.config_index
        c = per[i]
        c.episodes += 1
        c.successes += r.outcome == SUCCESS
        if r.reward is not None:
            c.rewarded += 1
            sums[i] += r.reward
    for c, total in zip(per, sums):
        c.mean_reward = total / c.rewarded if c.rewarded else None
    outcomes = [r.outcome for r in results]
    return Summary(
        run_id=run_id,
        episodes=len(results),
        ran=sum(r.status == RAN for r in results),
        skipped=sum(r.status == SKIPPED for r in results),
        failed=outcomes.count(FAILURE),
        timeout=outcomes.count(TIMEOUT),
        grader_error=outcomes.count(GRADER_ERROR),
        interrupted=sum(r.interrupted for r in results),
        configs=per,
        elapsed_s=round(elapsed, 3),
    )


def render(s: Summary) -> str:
    lines = [
        f"run id {s.run_id}: {s.episodes} episodes: {s.ran} ran, {s.skipped} skipped "
        f"(finished before), {s.failed} failed, {s.timeout} timeout, "
        f"{s.grader_error} grader error, {s.interrupted} interrupted attempts redone; "
        f"{s.elapsed_s:.1f} s",
        "",
    ]
    rows = [("config", "episodes", "success", "mean reward")]
    for c in s.configs:
        name = ",".join(f"{k}={_text(v)}" for k, v in c.config.items()) or "(none)"
        mean = "-" if c.mean_reward is None else f"{c.mean_reward:.3f}"
        rows.append((name, str(c.episodes), str(c.successes), mean))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        lines.append(
            "  ".join([row[0].ljust(widths[0]), *(v.rjust(w) for v, w in zip(row[1:], widths[1:]))])
        )
    return "\n".join(lines)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else msgspec.json.encode(value).decode()
