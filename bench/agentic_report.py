"""The agentic replay's figures: medians over rounds, per arm, against direct."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from statistics import median

BUCKETS = (("<10k", 0, 10_000), ("10-30k", 10_000, 30_000), ("30-60k", 30_000, 60_000),
           (">=60k", 60_000, 1 << 40))


@dataclass
class ArmRun:
    arm: str
    alone: dict  # the load generator's single-session run
    together: dict  # its concurrent run
    store: dict | None = None  # agentic_store.database_figures
    calls_expected: int = 0
    unique_tokens: int = 0
    round: int = 0
    extra: dict = field(default_factory=dict)


def _bucket(context: int) -> str:
    return next(name for name, low, high in BUCKETS if low <= context < high)


def _by_bucket(turns: list[dict], key: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for t in turns:
        if t.get(key) is not None and t["ok"]:
            out.setdefault(_bucket(t["context"]), []).append(t[key])
    return out


def _medians(runs: list[ArmRun], part: str, key: str) -> dict[str, float]:
    pooled: dict[str, list[float]] = {}
    for run in runs:
        for bucket, values in _by_bucket(getattr(run, part)["turns"], key).items():
            pooled.setdefault(bucket, []).extend(values)
    return {b: median(v) for b, v in pooled.items()}


def _throughput(run: ArmRun, out: int) -> float:
    ok = sum(1 for t in run.together["turns"] if t["ok"])
    return ok * out / run.together["elapsed"]


def _rss_per_million(run: ArmRun) -> float | None:
    samples = run.together["samples"]
    peak_tokens = max((tokens for tokens, _ in samples), default=0)
    if not peak_tokens:
        return None
    growth = max(rss for _, rss in samples) - run.together["rss_start"]
    return growth / (1 << 20) / (peak_tokens / 1e6)


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1, sign: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value * scale:+.{digits}f}" if sign else f"{value * scale:.{digits}f}"


def print_report(runs: list[ArmRun], args: argparse.Namespace, load0: tuple,
                 load1: tuple) -> dict:
    arms = list(dict.fromkeys(r.arm for r in runs))
    by_arm = {a: [r for r in runs if r.arm == a] for a in arms}
    direct = {r.round: r for r in by_arm["direct"]}
    reference = {(t["session"], t["turn"]): t["digest"]
                 for r in by_arm["direct"] for part in (r.alone, r.together)
                 for t in part["turns"]}
    names = [b[0] for b in BUCKETS]
    direct_alone = _medians(by_arm["direct"], "alone", "ttft")
    direct_together = _medians(by_arm["direct"], "together", "ttft")
    figures: dict = {"arms": {}, "checks_pass": True}
    top = args.system + args.turns * (args.tool + args.out)
    print(f"\n{args.sessions} sessions x {args.turns} turns, tool result {args.tool} tokens, "
          f"{args.out} streamed per turn, context up to {top:,} tokens; client {args.client}; "
          f"{args.rounds} round(s), medians; load average {load0[0]:.1f} at start, "
          f"{load1[0]:.1f} at end ({len(__import__('os').sched_getaffinity(0))} cores)")
    header = "".join(f"{n:>9}" for n in names)
    rows: list[str] = []
    for arm in arms:
        rs = by_arm[arm]
        fig: dict = {}
        kept = [_throughput(r, args.out) / _throughput(direct[r.round], args.out)
                for r in rs if r.round in direct]
        fig["throughput_tokens_s"] = median(_throughput(r, args.out) for r in rs)
        fig["kept"] = median(kept) if kept else None
        fig["loadgen_cpu_share"] = max(r.together["loadgen_cpu"] / r.together["elapsed"]
                                       for r in rs)
        fig["engine_cpu_share"] = median(r.together.get("engine_cpu", 0) / r.together["elapsed"]
                                         for r in rs)
        turns_ok = all(t["ok"] for r in rs for part in (r.alone, r.together)
                       for t in part["turns"])
        compared = [t["digest"] == reference.get((t["session"], t["turn"]))
                    for r in rs for part in (r.alone, r.together) for t in part["turns"]]
        fig["identical"] = f"{sum(compared)}/{len(compared)}"
        ok = turns_ok and all(compared)
        if arm != "direct":
            fig["cpu_ms_alone"] = {b: v * 1e3 for b, v in _medians(rs, "alone", "cpu").items()}
            fig["faults_alone"] = _medians(rs, "alone", "faults")
            fig["cpu_ms_concurrent"] = median(
                r.together["proxy_cpu"] / len(r.together["turns"]) for r in rs) * 1e3
            alone, together = _medians(rs, "alone", "ttft"), _medians(rs, "together", "ttft")
            fig["ttft_ms_alone"] = {b: (alone[b] - direct_alone[b]) * 1e3
                                    for b in alone if b in direct_alone}
            fig["ttft_ms_concurrent"] = {b: (together[b] - direct_together[b]) * 1e3
                                         for b in together if b in direct_together}
            idle = [r.extra["idle_ms_s"] for r in rs if r.extra.get("idle_ms_s") is not None]
            fig["idle_ms_s"] = median(idle) if idle else None
            rss = [v for v in map(_rss_per_million, rs) if v is not None]
            fig["rss_mib_per_mtok"] = median(rss) if rss else None
            stores = [r for r in rs if r.store]
            if not stores:  # the bare relay stores nothing
                fig["pass"] = ok
                figures["checks_pass"] &= ok
                figures["arms"][arm] = fig
                continue
            fig["bytes_per_unique_token"] = median(r.store["bytes"] / r.unique_tokens
                                                   for r in stores)
            fig["stored_ids_per_unique_token"] = median(r.store["stored_ids"] / r.unique_tokens
                                                        for r in stores)
            zero_drop = all(r.store["calls"] == r.calls_expected == r.store["calls_ok"]
                            and r.store["completion_ids"] == r.calls_expected * args.out
                            and r.store["ids_match"] for r in stores)
            made = sum(r.calls_expected for r in stores)
            kept_calls = sum(r.store["calls_ok"] for r in stores)
            fig["zero_drop"] = zero_drop
            ok = ok and zero_drop
            rows.append(f"{arm}: calls made {made}, in the database {kept_calls} with status ok; "
                        f"completion ids {sum(r.store['completion_ids'] for r in stores)}"
                        f"/{made * args.out}; replies byte-identical to direct: "
                        f"{fig['identical']}; the lone session's ids read back exact: "
                        f"{all(r.store['ids_match'] for r in stores)}")
        fig["pass"] = ok
        figures["checks_pass"] &= ok
        figures["arms"][arm] = fig

    print(f"\n{'':<34}" + "".join(f"{a:>12}" for a in arms))
    line = lambda label, vals: print(f"{label:<34}" + "".join(f"{v:>12}" for v in vals))  # noqa: E731
    f = figures["arms"]
    line("completion tokens/s (concurrent)", [_fmt(f[a]["throughput_tokens_s"], digits=0)
                                               for a in arms])
    line("throughput kept vs direct", [_fmt(f[a]["kept"], digits=2) for a in arms])
    line("proxy CPU ms/turn (concurrent)", [_fmt(f[a].get("cpu_ms_concurrent")) for a in arms])
    line("proxy RSS MiB per M tokens in flight", [_fmt(f[a].get("rss_mib_per_mtok"), digits=0)
                                                  for a in arms])
    line("idle CPU ms per s (0.1% of a core)", [_fmt(f[a].get("idle_ms_s"), digits=2)
                                               for a in arms])
    line("DB bytes per unique token", [_fmt(f[a].get("bytes_per_unique_token")) for a in arms])
    line("stored ids / unique tokens", [_fmt(f[a].get("stored_ids_per_unique_token"), digits=2)
                                        for a in arms])
    line("load generator CPU (share of a core)", [_fmt(f[a]["loadgen_cpu_share"], digits=2)
                                                  for a in arms])
    line("engine CPU (share of a core)", [_fmt(f[a]["engine_cpu_share"], digits=2)
                                          for a in arms])
    for title, key, sign in (("proxy CPU ms per turn, one session alone", "cpu_ms_alone", False),
                             ("proxy minor page faults per turn, one session alone",
                              "faults_alone", False),
                             ("added TTFT ms, one session alone", "ttft_ms_alone", True),
                             ("added TTFT ms, concurrent", "ttft_ms_concurrent", True)):
        print(f"\n{title}, by context tokens\n{'':<34}{header}")
        for arm in arms[1:]:
            vals = f[arm].get(key, {})
            print(f"  {arm:<32}" + "".join(f"{_fmt(vals.get(n), sign=sign):>9}" for n in names))
    print()
    for row in rows:
        print(row)
    for arm in arms:
        print(f"[{'PASS' if f[arm]['pass'] else 'FAIL'}] {arm}: every turn complete"
              + ("" if arm in ("direct", "relay")
                 else ", every call in the database, replies as direct"))
    return figures
