"""viewer.interval_plots: the geometry of the per-level and Δ_B plots (no browser; the
browser test, tests/test_viewer_plots_browser.py, checks what Chromium draws)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tracetap.analysis.coverage import Coverage, Level
from tracetap.viewer.interval_plots import LEFT, RIGHT, WIDTH, delta_plot, level_plot

PLOT_W = WIDTH - LEFT - RIGHT


def _level(name: str, rate, interval) -> Level:
    return Level(
        factor="f",
        level=name,
        episodes=0 if rate is None else 4,
        success_rate=rate,
        success_interval=interval,
        mean_reward=None,
        reward_interval=None,
    )


def test_levels_sit_on_zero_to_one_and_a_level_that_never_ran_draws_nothing():
    report = Coverage(
        episodes=4,
        factors=["f"],
        unset={"f": 0},
        pairs=0,
        unseen_pairs=[],
        levels=[_level("a", 0.25, (0.05, 0.7)), _level("b", None, None)],
    )
    plot = level_plot(report)
    a, b = plot.rows
    assert (a.x, a.x_low, a.x_high) == pytest.approx(
        (LEFT + PLOT_W * 0.25, LEFT + PLOT_W * 0.05, LEFT + PLOT_W * 0.7), abs=0.01
    )
    assert a.title == "f=a: 0.250 [0.050, 0.700]" and b.title == "f=b: never ran"
    assert b.x is None and plot.zero is None
    assert [t.label for t in plot.ticks] == ["0.00", "0.25", "0.50", "0.75", "1.00"]
    assert plot.summary == "Success per level (Wilson 95% interval): f=a: 0.250 [0.050, 0.700]"


def _candidate(selector: str, delta: float, interval) -> SimpleNamespace:
    # Only what the plot reads of analysis.compare.Candidate.
    return SimpleNamespace(
        variant=SimpleNamespace(selector=selector), delta=delta, interval=interval
    )


def test_delta_axis_is_symmetric_and_colours_say_whether_the_interval_excludes_zero():
    result = SimpleNamespace(
        baseline=SimpleNamespace(selector="harness=A"),
        candidates=[
            _candidate("harness=B", 0.3, (0.1, 0.45)),
            _candidate("harness=C", -0.2, (-0.3, -0.05)),
            _candidate("harness=D", 0.0, (-0.1, 0.1)),
        ],
    )
    plot = delta_plot(result)
    assert (plot.axis_low, plot.axis_high) == (-0.5, 0.5)  # 0.45 rounds up to 0.5
    assert plot.zero == pytest.approx(LEFT + PLOT_W / 2)
    assert [r.css for r in plot.rows] == ["up", "down", "level"]
    assert plot.rows[0].x == pytest.approx(LEFT + PLOT_W * 0.8, abs=0.01)  # 0.3 of ±0.5
    assert plot.ticks[0].label == "-0.50" and plot.ticks[-1].label == "+0.50"
