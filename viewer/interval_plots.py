"""Interval plots (a point and its 95% interval per row), drawn as inline SVG by the
templates, like viewer.charts: per-level success with its Wilson interval on the
harnesses page (and, with held-out configs, held-out minus the rest per level), Δ_B with
its bootstrap interval per candidate on the variants page.

Geometry only: each row's value and interval become x positions on a fixed axis
(success rates on 0..1; differences on a range symmetric around 0, so the zero line is
in the middle), and the template places them. Every row also carries its numbers as
text (the title and the table beside it), so the plot is never the only place to read
them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from tracetap.analysis.compare import Comparison
from tracetap.analysis.coverage import Coverage
from tracetap.analysis.held_out import HeldOut

WIDTH = 640
LEFT, RIGHT, TOP, BOTTOM = 200, 16, 8, 28  # LEFT holds the row labels
ROW_H = 22


class Tick(msgspec.Struct, kw_only=True):
    at: float  # x
    label: str


class Row(msgspec.Struct, kw_only=True):
    label: str
    value: float | None  # None: nothing to draw (a level that never ran)
    low: float | None
    high: float | None
    x: float | None
    x_low: float | None
    x_high: float | None
    y: float
    title: str  # the row in words
    note: str  # shown instead of a point when there is no value
    css: str  # a class for the marker ("up", "down", "level")


class IntervalPlot(msgspec.Struct, kw_only=True):
    id: str
    title: str
    summary: str  # the plot in words (its aria label)
    rows: list[Row]
    ticks: list[Tick]
    width: int
    height: int
    left: int
    top: int
    plot_w: int
    plot_h: int
    axis_low: float
    axis_high: float
    zero: float | None  # x of the zero line (differences)


def _plot(
    id_: str,
    title: str,
    items: Sequence[tuple],
    low: float,
    high: float,
    fmt: str,
    difference: bool,
    missing: str = "never ran",
) -> IntervalPlot:
    plot_w = WIDTH - LEFT - RIGHT
    plot_h = max(1, len(items)) * ROW_H

    def x(v: float) -> float:
        return round(LEFT + plot_w * (v - low) / (high - low), 2)

    rows = []
    for i, (label, value, interval, css) in enumerate(items):
        y = TOP + i * ROW_H + ROW_H / 2
        if value is None or interval is None:
            rows.append(
                Row(
                    label=label,
                    value=None,
                    low=None,
                    high=None,
                    x=None,
                    x_low=None,
                    x_high=None,
                    y=y,
                    title=f"{label}: {missing}",
                    note=missing,
                    css=css,
                )
            )
            continue
        lo, hi = interval
        text = f"{label}: {value:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"
        rows.append(
            Row(
                label=label,
                value=value,
                low=lo,
                high=hi,
                x=x(value),
                x_low=x(lo),
                x_high=x(hi),
                y=y,
                title=text,
                note="",
                css=css,
            )
        )
    steps = 4
    ticks = [
        Tick(
            at=x(low + (high - low) * k / steps),
            label=f"{low + (high - low) * k / steps:{'+.2f' if difference else '.2f'}}",
        )
        for k in range(steps + 1)
    ]
    drawn = [r for r in rows if r.value is not None]
    summary = f"{title}: " + ("; ".join(r.title for r in drawn) if drawn else "nothing ran")
    return IntervalPlot(
        id=id_,
        title=title,
        summary=summary,
        rows=rows,
        ticks=ticks,
        width=WIDTH,
        height=TOP + plot_h + BOTTOM,
        left=LEFT,
        top=TOP,
        plot_w=plot_w,
        plot_h=plot_h,
        axis_low=low,
        axis_high=high,
        zero=x(0.0) if difference else None,
    )


def level_plot(report: Coverage) -> IntervalPlot:
    """Success rate and Wilson 95% interval of every level, on 0..1."""
    items = [
        (f"{r.factor}={r.level}", r.success_rate, r.success_interval, "level")
        for r in report.levels
    ]
    return _plot(
        "level-plot",
        "Success per level (Wilson 95% interval)",
        items,
        0.0,
        1.0,
        ".3f",
        difference=False,
    )


def _symmetric(values: Sequence[float]) -> float:
    """The axis's half-width: a quarter step (0.25, 0.5, 0.75 or 1) holding every value."""
    reach = max([abs(v) for v in values] + [0.05])
    return min(1.0, math.ceil(reach * 4) / 4)


def _css(interval: tuple[float, float] | None) -> str:
    if interval is None:
        return "level"
    return "up" if interval[0] > 0 else "down" if interval[1] < 0 else "level"


def held_out_plot(h: HeldOut) -> IntervalPlot:
    """Held-out minus rest success, overall and per level, with Newcombe's interval."""
    splits = [("all", h.overall), *((f"{r.factor}={r.level}", r.split) for r in h.levels)]
    items = [
        (label, s.difference, s.difference_interval, _css(s.difference_interval))
        for label, s in splits
    ]
    bound = _symmetric(
        [
            v
            for _, s in splits
            if s.difference_interval
            for v in (s.difference, *s.difference_interval)
        ]
    )
    return _plot(
        "held-out-plot",
        "Held-out minus other configs' success (Newcombe 95% interval)",
        items,
        -bound,
        bound,
        "+.3f",
        difference=True,
        missing="held out or not, not both",
    )


def delta_plot(result: Comparison) -> IntervalPlot:
    """Δ_B and its paired bootstrap 95% interval per candidate, around 0."""
    items = [(c.variant.selector, c.delta, c.interval, _css(c.interval)) for c in result.candidates]
    bound = _symmetric([v for c in result.candidates for v in (c.delta, *c.interval)])
    return _plot(
        "delta-plot",
        f"Δ_B against {result.baseline.selector} (paired bootstrap 95% interval)",
        items,
        -bound,
        bound,
        "+.3f",
        difference=True,
    )
