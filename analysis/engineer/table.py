"""The candidates as a table: validity, Δ_B with its interval, fixed and broken tasks,
and the reward written to each engineer episode."""

from __future__ import annotations

from tracetap.analysis.engineer.loop import Row


def render(rows: list[Row], penalty: float) -> str:
    lines = [
        f"{'candidate':<40} {'patch':<17} {'valid':<5} {'Δ_B':>6} {'interval':>16} "
        f"{'reward':>7}  fixed / broken or why invalid",
    ]
    for r in rows:
        if r.valid:
            low, high = r.interval or (0.0, 0.0)
            detail = f"fixed {_few(r.fixed)}; broken {_few(r.broken)}"
            lines.append(
                f"{r.episode_id[-40:]:<40} {r.patch or '-':<17} {'yes':<5} "
                f"{r.delta:>+6.2f} [{low:>+6.2f}, {high:>+6.2f}] {r.reward:>+7.2f}  "
                f"{detail}"
            )
        else:
            lines.append(
                f"{r.episode_id[-40:]:<40} {r.patch or '-':<17} {'no':<5} "
                f"{'-':>6} {'-':>16} {r.reward:>+7.2f}  {(r.why or '')[:90]}"
            )
    lines.append(
        f"(an invalid patch's reward is the penalty, {penalty:+g}; a valid one's "
        "is its Δ_B; tracetap export gives the engineer episodes by group)"
    )
    return "\n".join(lines)


def _few(tasks: list[str], shown: int = 4) -> str:
    if not tasks:
        return "none"
    more = f" +{len(tasks) - shown}" if len(tasks) > shown else ""
    return ", ".join(tasks[:shown]) + more
