"""``tracetap drift DIR``: why an export's trajectories split, per cause, harness and episode.

Reads ``DIR/trajectories`` (the drift columns). Importing this module is cheap: pyarrow
loads only in ``run``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

_COLUMNS = ("trajectory_id", "episode_id", "harness", "split_reason", "call_ids",
            "drift_cause", "drift_position", "drift_message_index", "drift_expected_token",
            "drift_received_token", "drift_expected_text", "drift_received_text")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("export_dir", metavar="DIR", help="an export directory (tracetap export --out DIR)")
    a("--json", action="store_true", help="print JSON instead of tables [default off]")
    a("--episode", action="append", default=[], metavar="ID",
      help="only this episode (repeatable)")


def report(rows: list[dict]) -> dict:
    """Splits with a drift ("non_prefix" and "branch" rows) by cause, by harness and by
    episode."""
    splits = [r for r in rows if r["drift_cause"] is not None]
    by_harness: dict[str, Counter] = defaultdict(Counter)
    episodes: dict[str, dict] = {}
    for r in splits:
        harness = r["harness"] or "(none)"
        by_harness[harness][r["drift_cause"]] += 1
        episode = episodes.setdefault(r["episode_id"], {"episode_id": r["episode_id"],
                                                        "harness": r["harness"], "splits": []})
        episode["splits"].append({
            "trajectory_id": r["trajectory_id"], "call_id": r["call_ids"][0],
            "cause": r["drift_cause"], "position": r["drift_position"],
            "message_index": r["drift_message_index"],
            "expected_token": r["drift_expected_token"],
            "received_token": r["drift_received_token"],
            "expected_text": r["drift_expected_text"],
            "received_text": r["drift_received_text"]})
    return {
        "trajectories": len(rows),
        "splits": len(splits),
        "other_rows": dict(Counter(r["split_reason"] or "main" for r in rows
                                   if r["drift_cause"] is None)),
        "by_cause": dict(Counter(r["drift_cause"] for r in splits).most_common()),
        "by_harness": {h: dict(c.most_common()) for h, c in sorted(by_harness.items())},
        "episodes": list(episodes.values()),
    }


def run(args: argparse.Namespace) -> int:
    import pyarrow.dataset as ds

    path = Path(args.export_dir) / "trajectories"
    if not path.is_dir():
        print(f"tracetap drift: error: no trajectories/ dataset in {args.export_dir}",
              file=sys.stderr)
        return 1
    dataset = ds.dataset(path, format="parquet")
    missing = [c for c in _COLUMNS if c not in dataset.schema.names]
    if missing:
        print(f"tracetap drift: error: {path} has no {', '.join(missing)} (exported by an "
              "older tracetap: export again)", file=sys.stderr)
        return 1
    table = dataset.to_table(columns=list(_COLUMNS))
    rows = table.to_pylist()
    if args.episode:
        rows = [r for r in rows if r["episode_id"] in set(args.episode)]
    data = report(rows)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print_tables(data)
    return 0


def _print_tables(data: dict) -> None:
    print(f"{data['splits']} of {data['trajectories']} trajectories split from their "
          f"episode's context (other rows: {_inline(data['other_rows']) or 'none'})")
    if not data["splits"]:
        return
    print("\nby cause")
    width = max(len(c) for c in data["by_cause"])
    for cause, n in data["by_cause"].items():
        print(f"  {cause:<{width}}  {n}")
    print("\nby harness")
    for harness, causes in data["by_harness"].items():
        print(f"  {harness}: {_inline(causes)}")
    print("\nby episode")
    for episode in data["episodes"]:
        print(f"  {episode['episode_id']} ({episode['harness'] or 'no harness'})")
        for s in episode["splits"]:
            where = "" if s["position"] is None else f"token {s['position']}"
            if s["message_index"] is not None:
                where += f", message {s['message_index']}"
            print(f"    {s['cause']:<24} {where:<22} expected {s['expected_text']!r} "
                  f"got {s['received_text']!r}")


def _inline(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items())
