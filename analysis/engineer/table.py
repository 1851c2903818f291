"""The candidates as a table: validity, Δ_B in-batch and held out with their intervals,
fixed and broken tasks, the reward written to each engineer episode and its advantage in
the group (invalid candidates in it with their penalty)."""

from __future__ import annotations

from tracetap.analysis.engineer.loop import Row


def render(rows: list[Row], penalty: float) -> str:
    lines = [
        f"{'candidate':<40} {'patch':<17} {'valid':<5} {'Δ_B in batch':>23} "
        f"{'Δ_B held out':>23} {'reward':>7} {'adv':>6}  fixed / broken or why invalid",
    ]
    for r in rows:
        adv = "-" if r.advantage is None else f"{r.advantage:+.3f}"
        if r.valid:
            detail = f"fixed {_few(r.fixed)}; broken {_few(r.broken)}"
            lines.append(
                f"{r.episode_id[-40:]:<40} {r.patch or '-':<17} {'yes':<5} "
                f"{_delta(r.delta, r.interval):>23} "
                f"{_delta(r.held_out_delta, r.held_out_interval):>23} "
                f"{r.reward:>+7.2f} {adv:>6}  {detail}"
            )
        else:
            lines.append(
                f"{r.episode_id[-40:]:<40} {r.patch or '-':<17} {'no':<5} "
                f"{'-':>23} {'-':>23} {r.reward:>+7.2f} {adv:>6}  {(r.why or '')[:90]}"
            )
    source = next((r.reward_from for r in rows if r.reward_from), "in-batch")
    lines.append(
        f"(an invalid patch's reward is the penalty, {penalty:+g}; a valid one's is its "
        f"{source} Δ_B; held out: the tasks not in the packets it was written from; "
        "advantages over the group, population std; tracetap export gives the engineer "
        "episodes by group)"
    )
    return "\n".join(lines)


def _delta(value: float | None, interval: tuple[float, float] | None) -> str:
    if value is None or interval is None:
        return "-"
    return f"{value:+.2f} [{interval[0]:+.2f}, {interval[1]:+.2f}]"


def _few(tasks: list[str], shown: int = 4) -> str:
    if not tasks:
        return "none"
    more = f" +{len(tasks) - shown}" if len(tasks) > shown else ""
    return ", ".join(tasks[:shown]) + more
