"""The proxy benchmark's table, ratios and target verdicts."""

from __future__ import annotations

import argparse
import os

from loadgen import Report, Target


def pct(values: list[float], q: float) -> float:
    """The q-quantile in milliseconds."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def figures_of(report: Report) -> dict[str, float]:
    s = report.samples
    c32, c1, st, s32 = s["c32"], s["c1"], s["c1_stream"], s["c32_stream"]
    return {
        "rps": c32.done / c32.elapsed, "c32p50": pct(c32.latencies, .5),
        "c32p99": pct(c32.latencies, .99), "c1p50": pct(c1.latencies, .5),
        "c1p99": pct(c1.latencies, .99), "c1best": min(c1.blocks, default=0) * 1000,
        "ttft": pct(st.ttfts, .5), "ttft99": pct(st.ttfts, .99),
        "ttftbest": min(st.blocks, default=0) * 1000, "srps": s32.done / s32.elapsed,
        "errors": sum(x.errors for x in s.values()),
        "c1cpu": 1000 * c1.cpu / max(c1.done, 1),
        "cpu": 1000 * c32.cpu / max(c32.done, 1), "scpu": 1000 * s32.cpu / max(s32.done, 1),
        "upcpu": 1000 * c32.upstream_cpu / max(c32.done, 1),
        "hdr": pct(c1.overheads, .5),
    }


COLUMNS = [  # (heading, figure, format)
    ("c32 rps", "rps", "{:.0f}"), ("c32 p50", "c32p50", "{:.2f}"),
    ("c32 p99", "c32p99", "{:.2f}"), ("c1 p50", "c1p50", "{:.3f}"),
    ("c1 p99", "c1p99", "{:.3f}"), ("c1 best", "c1best", "{:.3f}"),
    ("ttft p50", "ttft", "{:.3f}"), ("ttft p99", "ttft99", "{:.3f}"),
    ("ttft best", "ttftbest", "{:.3f}"), ("s-c32 rps", "srps", "{:.0f}"),
    ("errors", "errors", "{:.0f}"), ("c1 cpu", "c1cpu", "{:.3f}"),
    ("c32 cpu", "cpu", "{:.3f}"), ("s-c32 cpu", "scpu", "{:.3f}"),
    ("up cpu", "upcpu", "{:.3f}"), ("hdr p50", "hdr", "{:.3f}"),
]
LEGEND = """\
latencies in ms. c1 best / ttft best: the lowest median of the c=1 blocks (the quietest
moment the machine gave every target alike). c1 cpu, c32 cpu, s-c32 cpu: ms of CPU the
target process itself used per request (c=1 non-stream with its background work, c=32
non-stream, c=32 stream); up cpu: the upstream's, per request at c=32. hdr p50: tracetap's
own x-tracetap-overhead-ms at c=1. s-c32 rps: streams per second at c=32."""


def print_report(targets: list[Target], reports: dict[str, Report], finals: dict,
                 args: argparse.Namespace) -> None:
    figures = {t.name: figures_of(reports[t.name]) for t in targets}
    print(f"\n{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; client={args.client}, "
          f"rounds={args.rounds}; per target and round: c=1 {args.requests} requests + "
          f"{args.requests // 2} streams, c=32 {args.seconds:g} s + {args.seconds / 2:g} s "
          "streaming")
    print(LEGEND)
    print("target".rjust(15) + "".join(h.rjust(max(len(h), 7) + 2) for h, _, _ in COLUMNS))
    for t in targets:
        f = figures[t.name]
        cells = []
        for heading, key, fmt in COLUMNS:
            shown = fmt.format(f[key])
            if t.name == "direct" and key in ("c1cpu", "cpu", "scpu"):
                shown = "-"
            if shown == "nan":
                shown = "-"
            cells.append(shown.rjust(max(len(heading), 7) + 2))
        print(t.name.rjust(15) + "".join(cells))
    direct, relay = figures["direct"], figures["relay"]
    print()
    verdicts = []
    for t in targets:
        if not t.metrics:
            continue
        f, rep, m = figures[t.name], reports[t.name], finals[t.name]
        written = m.get("tracetap_records_total,outcome=written", 0)
        dropped = m.get("tracetap_records_total,outcome=dropped", 0)
        added = f["c1p50"] - direct["c1p50"]
        added_best = f["c1best"] - direct["c1best"]
        ttft_added = f["ttft"] - direct["ttft"]
        ttft_best = f["ttftbest"] - direct["ttftbest"]
        growth = rep.rss_after - rep.rss_warm
        print(f"{t.name}: throughput {f['rps'] / direct['rps']:.2f}x direct, "
              f"{f['rps'] / relay['rps']:.2f}x relay (streams {f['srps'] / relay['srps']:.2f}x "
              f"relay); c=1 p50 added {added:+.3f} ms (quietest block {added_best:+.3f}; "
              f"relay {relay['c1p50'] - direct['c1p50']:+.3f}); TTFT p50 added "
              f"{ttft_added:+.3f} ms (quietest {ttft_best:+.3f}; relay "
              f"{relay['ttft'] - direct['ttft']:+.3f}); CPU per request "
              f"{f['cpu'] / relay['cpu']:.2f}x relay")
        print(f"  records sent {rep.sent}, written {written:.0f}, dropped {dropped:.0f}; "
              f"queue depth max {rep.queue_peak:.0f}; RSS after warm-up {rep.rss_warm:.1f} MiB, "
              f"after c=32 {rep.rss_after:.1f} MiB ({growth:+.1f}); replies byte-identical to "
              f"direct: {rep.identical}")
        verdicts += [(t.name, *c) for c in (
            ("added latency c=1 p50 <= 1.0 ms", added <= 1.0,
             f"{added:.3f} ms (quietest block {added_best:.3f})"),
            ("throughput c=32 >= 0.8x relay", f["rps"] >= 0.8 * relay["rps"],
             f"{f['rps'] / relay['rps']:.2f}x"),
            ("zero errors", f["errors"] == 0, f"{f['errors']:.0f}"),
            ("zero dropped, all written", dropped == 0 and written == rep.sent,
             f"{dropped:.0f} dropped, {written:.0f}/{rep.sent} written"),
            ("TTFT added p50 <= 1.0 ms", ttft_added <= 1.0,
             f"{ttft_added:.3f} ms (quietest block {ttft_best:.3f})"),
            # A writer keeping up commits every ~50 ms; one that falls behind lets the
            # queue grow towards the run's whole record count.
            ("queue below 1 s of production", rep.queue_peak < f["rps"],
             f"max {rep.queue_peak:.0f} (1 s = {f['rps']:.0f} records)"),
            ("RSS growth <= 50 MiB", growth <= 50, f"{growth:+.1f} MiB"),
        )]
    print()
    for name, what, ok, shown in verdicts:
        print(f"  [{'PASS' if ok else 'MISS'}] {name:16} {what:34} {shown}")
    print_beside_relay(targets, figures, reports)


def print_beside_relay(targets: list[Target], figures: dict, reports: dict[str, Report]) -> None:
    """The non-streamed and idle rows of the capture-cost targets (docs/scaling.md):
    each tracetap variant beside the bare relay of the same run."""
    direct, relay = figures["direct"], figures["relay"]
    relay_added = relay["c1p50"] - direct["c1p50"]
    relay_idle = reports["relay"].idle_ms_s
    print("\nbeside the bare relay (same run; the streamed rows are bench/agentic.py's)")
    print(f"{'':<44}{'target':>20}{'tracetap':>12}{'relay':>10}{'ratio':>8}  goal")
    for t in targets:
        if not t.metrics:
            continue
        f, idle = figures[t.name], reports[t.name].idle_ms_s
        added = f["c1p50"] - direct["c1p50"]
        for label, mine, base, ratio, goal in (
                ("non-streamed c=1, added p50 ms", f"{added:+.3f}", f"{relay_added:+.3f}",
                 f"{added - relay_added:+.3f}", "<= relay + 0.3 ms"),
                ("non-streamed calls/s, c=32", f"{f['rps']:.0f}", f"{relay['rps']:.0f}",
                 f"{f['rps'] / relay['rps']:.2f}x", ">= 0.7x relay"),
                ("idle CPU ms per s (1 = 0.1% of a core)",
                 "-" if idle is None else f"{idle:.2f}",
                 "-" if relay_idle is None else f"{relay_idle:.2f}", "", "<= 2 ms/s")):
            print(f"{label:<44}{t.name:>20}{mine:>12}{base:>10}{ratio:>8}  {goal}")
