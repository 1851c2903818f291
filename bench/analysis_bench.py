"""Analysis benchmark: ``tracetap packets``, ``compare`` and ``harnesses`` on 10,000 episodes.

    python bench/analysis_bench.py                    # 10,000 episodes x 4 calls
    python bench/analysis_bench.py --episodes 1000    # a quick run

1. Builds (or reuses, by shape) a SQLite database under --workdir: episodes inserted in
   bulk into storage's ``episodes`` table (500 tasks, two harness variants, four factors;
   about 40% fail) and their calls through ``storage.rows.insert_calls``, with chat bodies
   of a few kB (the last request resends the whole conversation, as harnesses do).
2. Runs each command's work in this process (the CLI's own functions; packets written to
   a temp dir), --rounds times, and reports the median wall seconds, seconds per 10,000
   episodes, the ratio to a floor measured in the same rounds (``SELECT *`` of the
   episodes table through the standard library's sqlite3), and the CPU seconds of this
   process (on a shared, loaded machine wall time also counts waiting for a core).
Correctness checked at any size: one packet per failed episode, Δ_B equals the built
difference, every factor level counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sqlalchemy import insert  # noqa: E402

from tracetap.migrations import upgrade  # noqa: E402
from tracetap.proxy.apis.registry import readers  # noqa: E402
from tracetap.storage.engine import create_engine  # noqa: E402
from tracetap.storage.records import CallRecord, ChoiceRecord  # noqa: E402
from tracetap.storage.rows import insert_calls  # noqa: E402
from tracetap.storage.tables import Episode  # noqa: E402

TASKS = 500
TURNS = 4
FACTORS = {
    "context": ["full", "window", "summary"],
    "retries": [0, 1, 3],
    "tools": ["basic", "extended"],
    "temperature": [0.2, 0.7],
}


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--workdir", default=os.path.join(tempfile.gettempdir(), "tracetap-analysis-bench")
    )
    return parser.parse_args()


def _plan(n: int) -> list[dict]:
    """Episode e: harness A or B by parity, task (e // 2) % TASKS (so both variants run
    every task alike), a random factor config, success at a per-harness rate."""
    rng = random.Random(11)
    plans = []
    for e in range(n):
        harness = "AB"[e % 2]
        config = {f: levels[rng.randrange(len(levels))] for f, levels in FACTORS.items()}
        success = rng.random() < (0.55 if harness == "A" else 0.65)
        plans.append(
            {
                "id": f"ep-{e:06d}",
                "task": f"task-{(e // 2) % TASKS:04d}",
                "harness": harness,
                "config": config,
                "success": success,
            }
        )
    return plans


def _calls(plan: dict, start: float) -> list[CallRecord]:
    messages = [
        {"role": "system", "content": "You are a careful agent. " * 20},
        {"role": "user", "content": f"Solve {plan['task']}. " + "Details. " * 40},
    ]
    records = []
    for turn in range(TURNS):
        last = turn == TURNS - 1
        call = {
            "id": f"c{turn}",
            "type": "function",
            "function": {"name": "run", "arguments": json.dumps({"cmd": f"step {turn}"})},
        }
        reply = {"role": "assistant", "content": "done" if last else None}
        if not last:
            reply["tool_calls"] = [call]
        t = start + turn * 2.0
        records.append(
            CallRecord(
                call_id=f"{plan['id']}-{turn}",
                episode_id=plan["id"],
                seq=turn,
                instance="bench",
                endpoint="chat.completions",
                model="bench",
                policy_version="v1",
                request=json.dumps(
                    {
                        "model": "bench",
                        "messages": messages,
                        "tools": [
                            {"type": "function", "function": {"name": "run", "parameters": {}}}
                        ],
                    }
                ),
                response=json.dumps({"choices": [{"index": 0, "message": reply}]}),
                http_status=200,
                t_start=t,
                t_end=t + 1.0,
                prompt_tokens=300 + 100 * turn,
                completion_tokens=50,
                choices=[ChoiceRecord(index=0, finish_reason="stop", text="x")],
            )
        )
        messages = [*messages, reply]
        if not last:
            messages.append(
                {"role": "tool", "tool_call_id": f"c{turn}", "content": "output line\n" * 60}
            )
    return records


async def _build(url: str, plans: list[dict]) -> None:
    engine = create_engine(url)
    now = time.time()
    try:
        for first in range(0, len(plans), 500):
            batch = plans[first : first + 500]
            async with engine.begin() as conn:
                await conn.execute(
                    insert(Episode),
                    [
                        {
                            "id": p["id"],
                            "task_id": p["task"],
                            "harness_name": p["harness"],
                            "harness_config": json.dumps(p["config"]),
                            "registered": True,
                            "created_at": now,
                            "finished_at": now + 1,
                            "reward": 1.0 if p["success"] else 0.0,
                            "outcome": "success" if p["success"] else "failure",
                        }
                        for p in batch
                    ],
                )
            await insert_calls(engine, [r for p in batch for r in _calls(p, now)],
                               readers=readers())
            print(f"\rbuilding: {first + len(batch)}/{len(plans)} episodes", end="", flush=True)
        print()
    finally:
        await engine.dispose()


def _floor(path: Path) -> float:
    started = time.perf_counter()
    with sqlite3.connect(path) as conn:
        conn.execute("SELECT * FROM episodes").fetchall()
    return time.perf_counter() - started


def main() -> None:
    args = _arguments()
    from tracetap.analysis.compare import compare
    from tracetap.analysis.coverage import coverage
    from tracetap.analysis.design import Space, cover
    from tracetap.analysis.episodes import load
    from tracetap.analysis.packets import Options, build, write
    from tracetap.analysis.select import Success, parse_selector
    from tracetap.storage.scan import EpisodeFilter

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"analysis-{args.episodes}.db"
    url = f"sqlite:///{path}"
    plans = _plan(args.episodes)
    if not path.exists():
        upgrade(url)
        asyncio.run(_build(url, plans))
    filt, success = EpisodeFilter(), Success()
    space = Space(
        {
            f: [json.dumps(v) if not isinstance(v, str) else v for v in levels]
            for f, levels in FACTORS.items()
        }
    )
    out = Path(tempfile.mkdtemp(prefix="tracetap-packets-"))

    def packets():
        result = build(url, filt, Options(), readers())
        write(out, result)
        return result

    def compared():
        return compare(
            load(url, filt, costs=True),
            parse_selector("harness=A"),
            [parse_selector("harness=B")],
            success=success,
        )

    def covered():
        report = coverage(load(url, filt), success=success, space=space)
        report.design = cover(space, 24)
        return report

    jobs = {"packets": packets, "compare": compared, "harnesses": covered}
    figures = {name: [] for name in jobs}
    cpu = {name: [] for name in jobs}
    floors = []
    results = {}
    for _ in range(args.rounds):
        floors.append(_floor(path))
        for name, job in jobs.items():
            started, used = time.perf_counter(), time.process_time()
            results[name] = job()
            figures[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - used)
    failed = sum(not p["success"] for p in plans)
    by_task = {}
    for p in plans:
        by_task.setdefault((p["harness"], p["task"]), []).append(p["success"])
    tasks = sorted({p["task"] for p in plans})
    rate = {k: sum(v) / len(v) for k, v in by_task.items()}
    expected = statistics.fmean(
        rate[("B", t)] - rate[("A", t)] for t in tasks if ("A", t) in rate and ("B", t) in rate
    )
    checks = {
        "one packet per failed episode": len(results["packets"].packets) == failed,
        "Δ_B equals the built difference": abs(results["compare"].candidates[0].delta - expected)
        < 1e-12,
        "every factor level counted": all(
            r.episodes
            == sum(
                str(p["config"][r.factor]).lower() == r.level.lower()
                or json.dumps(p["config"][r.factor]) == r.level
                for p in plans
            )
            for r in results["harnesses"].levels
        ),
    }
    floor = statistics.median(floors)
    scale = 10_000 / args.episodes
    print(
        f"{args.episodes} episodes x {TURNS} calls, {failed} failed, {len(tasks)} tasks; "
        f"median of {args.rounds} rounds (in-process: the database read included)"
    )
    print(f"  {'command':<10} {'seconds':>8} {'per 10k episodes':>17} {'x floor':>8} {'CPU s':>7}")
    for name, times in figures.items():
        median = statistics.median(times)
        print(
            f"  {name:<10} {median:>8.3f} {median * scale:>16.3f}s {median / floor:>8.1f} "
            f"{statistics.median(cpu[name]):>7.3f}"
        )
    print(
        f"  {'floor':<10} {floor:>8.3f} {floor * scale:>16.3f}s  (SELECT * FROM episodes, sqlite3)"
    )
    for what, ok in checks.items():
        print(f"[{'PASS' if ok else 'FAIL'}] {what}")
    if not all(checks.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
