"""Chart geometry, drawn as SVG by the templates: no chart library, no script.

Each function turns numbers into positions in a fixed viewBox; the templates only place
them. Values come from the database (numbers), labels are escaped by the templates.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import msgspec

WIDTH, HEIGHT = 360, 170
LEFT, RIGHT, TOP, BOTTOM = 44, 8, 20, 34
PLOT_W, PLOT_H = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM


class Bar(msgspec.Struct, kw_only=True):
    x: float
    y: float
    w: float
    h: float
    label: str


class Tick(msgspec.Struct, kw_only=True):
    at: float
    label: str


class Line(msgspec.Struct, kw_only=True):
    name: str
    css: str
    points: str  # "x,y x,y ..."


class Chart(msgspec.Struct, kw_only=True):
    title: str
    summary: str  # the chart in words (alt text)
    bars: list[Bar] = []
    lines: list[Line] = []
    xticks: list[Tick] = []
    yticks: list[Tick] = []
    empty: bool = False
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    top: int = TOP
    plot_w: int = PLOT_W
    plot_h: int = PLOT_H


def left_out(title: str, count: int, why: str) -> str:
    """A panel's title that says how many episodes it leaves out, when it leaves some."""
    return f"{title} ({count:,} {why} left out)" if count else title


def histogram(title: str, values: Sequence[float], unit: str = "", bins: int = 12,
              integers: bool = False) -> Chart:
    if not values:
        return Chart(title=title, summary=f"{title}: no data yet", empty=True)
    lo, hi = min(values), max(values)
    if integers:
        span = hi - lo + 1
        bins = min(bins, int(span))
        width = span / bins
    else:
        width = (hi - lo) / bins if hi > lo else 1.0
        if hi == lo:
            bins = 1
    if bins == 1:  # one value: one bar of a twelfth of the width, not a solid block
        return _single(title, values, unit, lo)
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, int((v - lo) / width))] += 1
    top = max(counts)
    bar_w = PLOT_W / bins
    bars = []
    for i, n in enumerate(counts):
        a, b = lo + i * width, lo + (i + 1) * width
        label = (f"{_num(a)}\u2013{_num(b - 1 if integers else b)}{unit}: {n}" if bins > 1
                 else f"{_num(lo)}{unit}: {n}")
        h = PLOT_H * n / top
        bars.append(Bar(x=LEFT + i * bar_w + 1, y=TOP + PLOT_H - h, w=max(bar_w - 2, 1), h=h,
                        label=label))
    xticks = [Tick(at=LEFT, label=_num(lo)), Tick(at=LEFT + PLOT_W, label=_num(hi))]
    yticks = [Tick(at=TOP + PLOT_H, label="0"), Tick(at=TOP, label=str(top))]
    mean = sum(values) / len(values)
    summary = (f"{title}: {len(values)} values from {_num(lo)} to {_num(hi)}{unit}, "
               f"mean {_num(mean)}{unit}")
    return Chart(title=title, summary=summary, bars=bars, xticks=xticks, yticks=yticks)


def _single(title: str, values: Sequence[float], unit: str, value: float) -> Chart:
    w = PLOT_W / 12
    bar = Bar(x=LEFT + (PLOT_W - w) / 2, y=TOP, w=w, h=PLOT_H,
              label=f"{_num(value)}{unit}: {len(values)}")
    return Chart(title=title, summary=f"{title}: all {len(values)} values are {_num(value)}{unit}",
                 bars=[bar], xticks=[Tick(at=LEFT + PLOT_W / 2, label=_num(value))],
                 yticks=[Tick(at=TOP + PLOT_H, label="0"), Tick(at=TOP, label=str(len(values)))])


def percentiles_over_time(title: str, samples: Sequence[tuple[float, float, float | None]],
                          buckets: int = 24) -> Chart:
    """p50/p90/p99 of call duration and p50 of time to first byte, per time bucket."""
    if not samples:
        return Chart(title=title, summary=f"{title}: no calls yet", empty=True)
    t0, t1 = samples[0][0], samples[-1][0]
    width = (t1 - t0) / buckets if t1 > t0 else 1.0
    groups: list[list[tuple[float, float | None]]] = [[] for _ in range(buckets)]
    for t, duration, ttft in samples:
        groups[min(buckets - 1, int((t - t0) / width))].append((duration, ttft))
    series = {"p50": [], "p90": [], "p99": [], "ttft p50": []}
    for i, group in enumerate(groups):
        if not group:
            continue
        durations = sorted(d for d, _ in group)
        ttfts = sorted(f for _, f in group if f is not None)
        at = t0 + (i + 0.5) * width
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            series[name].append((at, _quantile(durations, q)))
        if ttfts:
            series["ttft p50"].append((at, _quantile(ttfts, 0.5)))
    top = max(v for points in series.values() for _, v in points) or 1.0
    span = (t1 - t0) or 1.0

    def xy(t: float, v: float) -> str:
        x = LEFT + PLOT_W * ((t - t0) / span if t1 > t0 else 0.5)
        return f"{x:.1f},{TOP + PLOT_H - PLOT_H * v / top:.1f}"

    lines = [Line(name=name, css=f"s{i}", points=" ".join(xy(t, v) for t, v in points))
             for i, (name, points) in enumerate(series.items()) if points]
    xticks = [Tick(at=LEFT, label=_clock(t0)), Tick(at=LEFT + PLOT_W, label=_clock(t1))]
    yticks = [Tick(at=TOP + PLOT_H, label="0"), Tick(at=TOP, label=seconds(top))]
    durations = sorted(d for _, d, _ in samples)
    summary = (f"{title}: {len(samples)} calls, p50 {seconds(_quantile(durations, 0.5))}, "
               f"p90 {seconds(_quantile(durations, 0.9))}, "
               f"p99 {seconds(_quantile(durations, 0.99))}")
    return Chart(title=title, summary=summary, lines=lines, xticks=xticks, yticks=yticks)


class Lane(msgspec.Struct, kw_only=True):
    x: float
    w: float
    y: float
    ttft_w: float  # the part before the first byte
    failed: bool
    call_id: str
    label: str


class Timeline(msgspec.Struct, kw_only=True):
    bars: list[Lane]
    width: int
    height: int
    ticks: list[Tick]
    lanes: int


def timeline(calls: Sequence, width: int = 960, lane_h: int = 14) -> Timeline:
    """Calls as bars on time; concurrent calls get their own lanes."""
    placed = [c for c in calls if c.t_end is not None]
    if not placed:
        return Timeline(bars=[], width=width, height=0, ticks=[], lanes=0)
    t0 = min(c.t_start for c in placed)
    t1 = max(c.t_end for c in placed)
    span = (t1 - t0) or 1e-3
    scale = (width - 20) / span
    lane_ends: list[float] = []
    bars = []
    for c in sorted(placed, key=lambda c: c.t_start):
        lane = next((i for i, end in enumerate(lane_ends) if end <= c.t_start), len(lane_ends))
        if lane == len(lane_ends):
            lane_ends.append(c.t_end)
        lane_ends[lane] = c.t_end
        ttft = (c.t_first_byte - c.t_start) if c.t_first_byte is not None else 0.0
        w = max((c.t_end - c.t_start) * scale, 2.0)
        label = (f"call {c.seq}: {c.endpoint}, {c.status} {c.http_status}, "
                 f"start +{seconds(c.t_start - t0)}, duration {seconds(c.t_end - c.t_start)}"
                 + (f", first byte {seconds(ttft)}" if c.t_first_byte is not None else ""))
        bars.append(Lane(x=10 + (c.t_start - t0) * scale, w=w, y=4 + lane * lane_h,
                         ttft_w=min(max(ttft * scale, 0.0), w), failed=c.failed,
                         call_id=c.call_id, label=label))
    lanes = len(lane_ends)
    height = 4 + lanes * lane_h + 18
    ticks = [Tick(at=10 + (width - 20) * f, label="+" + seconds(span * f))
             for f in (0, 0.25, 0.5, 0.75, 1)]
    return Timeline(bars=bars, width=width, height=height, ticks=ticks, lanes=lanes)


def _quantile(ordered: Sequence[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _num(v: float) -> str:
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.2f}".rstrip("0").rstrip(".") if v != int(v) else str(int(v))


def seconds(v: float | None) -> str:
    if v is None:
        return "\u2013"
    if v < 1:
        return f"{v * 1000:.0f} ms"
    if v < 120:
        return f"{v:.2f} s"
    return f"{v / 60:.1f} min"


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(t))
