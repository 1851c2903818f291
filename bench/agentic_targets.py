"""The agentic replay's figures beside the bare relay's: one row per target of the
capture-cost work (docs/scaling.md), tracetap's value, the relay's, and their ratio.

Rows (each from the same invocation of bench/agentic.py, so the arms saw one machine):
proxy CPU per turn alone at 10-30k and at >=60k context, unpaced and, with ``--paced``,
paced (each event its own read); how flat it is from 10-30k to >=60k; throughput kept
with all sessions at once, unpaced; idle CPU; database bytes per unique token; added time
to the first token alone at >=60k. The non-streamed rows (c=1 added p50, c=32 calls/s)
are bench/proxy_bench.py's.
"""

from __future__ import annotations

MID, TOP = "10-30k", ">=60k"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or not b else f"{a / b:.2f}x"


def _v(value: float | None, digits: int = 1, sign: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def target_rows(unpaced: dict, paced: dict | None, token_delay: float | None) -> list[tuple]:
    """``(row, arm, tracetap value, relay value, ratio or difference, target)`` for each
    tracetap arm; ``unpaced``/``paced``: print_report's figures of each run."""
    arms = [a for a in unpaced["arms"] if a not in ("direct", "relay")]
    relay = unpaced["arms"].get("relay")
    rows = []
    if relay is None:
        return rows
    for arm in arms:
        f = unpaced["arms"][arm]
        for label, figs in (("unpaced", unpaced), ("paced", paced)):
            if figs is None or arm not in figs["arms"] or "relay" not in figs["arms"]:
                continue
            mine, base = figs["arms"][arm]["cpu_ms_alone"], figs["arms"]["relay"]["cpu_ms_alone"]
            what = label if label == "unpaced" else f"paced {token_delay * 1e3:g} ms/token"
            goal = "<= 2x relay" if label == "unpaced" else "<= 1.3x relay"
            rows.append((f"proxy CPU ms/turn alone, {MID} -> {TOP}, {what}", arm,
                         f"{_v(mine.get(MID))} -> {_v(mine.get(TOP))}",
                         f"{_v(base.get(MID))} -> {_v(base.get(TOP))}",
                         _ratio(mine.get(TOP), base.get(TOP)), goal))
            rows.append((f"  flatness {TOP} / {MID}, {what}", arm,
                         _ratio(mine.get(TOP), mine.get(MID)),
                         _ratio(base.get(TOP), base.get(MID)), "", "<= 1.3x"))
        rows.append(("throughput kept vs direct, all sessions, unpaced", arm,
                     _v(f["kept"], 2), _v(relay["kept"], 2), _ratio(f["kept"], relay["kept"]),
                     ">= 0.9x relay"))
        rows.append(("idle CPU, ms per s (1 = 0.1% of a core)", arm,
                     _v(f.get("idle_ms_s"), 2), _v(relay.get("idle_ms_s"), 2), "",
                     "<= 2 ms/s"))
        rows.append(("database bytes per unique token", arm,
                     _v(f.get("bytes_per_unique_token")), "-", "", "<= 8"))
        mine, base = f["ttft_ms_alone"].get(TOP), relay["ttft_ms_alone"].get(TOP)
        diff = None if mine is None or base is None else mine - base
        rows.append((f"added TTFT ms alone, {TOP}, unpaced", arm, _v(mine, sign=True),
                     _v(base, sign=True), _v(diff, sign=True), "<= relay + 2 ms"))
    return rows


def print_targets(unpaced: dict, paced: dict | None, token_delay: float | None) -> list[tuple]:
    rows = target_rows(unpaced, paced, token_delay)
    if not rows:
        return rows
    print("\nbeside the bare relay (same run; the non-streamed rows are "
          "bench/proxy_bench.py's)")
    print(f"{'':<62}{'arm':>8}{'tracetap':>16}{'relay':>16}{'ratio':>9}  target")
    for label, arm, mine, base, ratio, goal in rows:
        print(f"{label:<62}{arm:>8}{mine:>16}{base:>16}{ratio:>9}  {goal}")
    return rows
