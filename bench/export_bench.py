"""Export benchmark: a synthetic database → ``tracetap export``, against pyarrow alone.

    python bench/export_bench.py                     # 10,000 episodes x 8 turns x 256 tokens
    python bench/export_bench.py --episodes 1000     # a quick run

1. Builds (or reuses, by shape) a SQLite database under --workdir through storage's own
   bulk insert (``storage.rows.insert_calls``) and ``queries.finish_episode``.
2. Exports it in a child process, so its peak RSS is the exporter's alone (VmHWM).
3. Reads both exported datasets back into memory and times pyarrow writing those same
   tables with the same writer settings: the ceiling for the write half of the job.
Reported over --rounds rounds (export and baseline alternated, for a shared machine's
moods): token ids written per second, peak RSS, and ratio = pyarrow-only / export time
(1.0 would mean reading the database and building trajectories cost nothing), each
round's and the median.
Peak RSS should not grow with --episodes: compare a run at 1,000 and one at 10,000.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tracetap.migrations import upgrade  # noqa: E402
from tracetap.proxy.apis.registry import readers  # noqa: E402
from tracetap.storage import queries  # noqa: E402
from tracetap.storage.engine import create_engine  # noqa: E402
from tracetap.storage.records import CallRecord, ChoiceRecord  # noqa: E402
from tracetap.storage.rows import insert_calls  # noqa: E402

BATCH_EPISODES = 250


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=10_000)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--completion-tokens", type=int, default=256)
    parser.add_argument("--observation-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3,
                        help="exports and baselines, alternated; medians are reported")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(),
                                                          "tracetap-export-bench"))
    parser.add_argument("--export-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--db", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args()


# ---- the synthetic database --------------------------------------------------------------

def _episode_records(args, e: int, rng: random.Random, logprob_pool: list[list[float]],
                     start: float) -> list[CallRecord]:
    step = args.completion_tokens + args.observation_tokens
    total = args.prompt_tokens + args.turns * step
    full = array("H", rng.randbytes(2 * total)).tolist()
    records = []
    for turn in range(args.turns):
        prompt_end = args.prompt_tokens + turn * step
        completion = full[prompt_end:prompt_end + args.completion_tokens]
        t = start + turn * 2.0
        records.append(CallRecord(
            call_id=f"{e:08d}-{turn:04d}-bench", episode_id=f"ep-{e:08d}", seq=turn,
            instance="bench", endpoint="chat.completions", model="bench-model",
            policy_version="v1", request='{"model":"bench-model","messages":[]}',
            response='{"object":"chat.completion","choices":[]}', http_status=200,
            t_start=t, t_first_byte=t + 0.1, t_end=t + 1.0, upstream_latency=0.9,
            prompt_tokens=prompt_end, completion_tokens=len(completion),
            prompt_ids=full[:prompt_end],
            choices=[ChoiceRecord(index=0, finish_reason="stop", completion_ids=completion,
                                  completion_logprobs=logprob_pool[(e + turn) % 16],
                                  token_source="engine")],
        ))
    return records


async def _build(args, url: str) -> None:
    engine = create_engine(url)
    rng = random.Random(7)
    pool = [[-rng.random() * 2 for _ in range(args.completion_tokens)] for _ in range(16)]
    start = time.time() - 10 * args.episodes
    try:
        for first in range(0, args.episodes, BATCH_EPISODES):
            batch = range(first, min(first + BATCH_EPISODES, args.episodes))
            records = [r for e in batch
                       for r in _episode_records(args, e, rng, pool, start + 10 * e)]
            await insert_calls(engine, records, readers=readers())
            for e in batch:
                await queries.finish_episode(engine, f"ep-{e:08d}", reward=float(e % 2),
                                             rewards=None, outcome="done", info=None)
            print(f"\rbuilding: {batch.stop}/{args.episodes} episodes", end="", flush=True)
        print()
    finally:
        await engine.dispose()


# ---- measuring ---------------------------------------------------------------------------

def _export_child(args) -> None:
    from tracetap.exporters import export

    started = time.perf_counter()
    summary = export(args.db, args.out)
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "episodes": summary.episodes,
                      "calls": summary.call_rows, "trajectories": summary.trajectories,
                      "tokens": summary.tokens, "files": summary.files,
                      "peak_rss_mib": _peak_rss_mib()}))


def _peak_rss_mib() -> float:
    # VmHWM is this process image's own peak; getrusage's ru_maxrss would also carry the
    # parent's peak across fork and exec (the baseline holds whole tables in memory).
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _measure_export(url: str, out: Path) -> tuple[dict, float]:
    cmd = [sys.executable, __file__, "--export-only", "--db", url, "--out", str(out)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, check=False)
    if done.returncode != 0:
        raise SystemExit(f"export failed ({done.returncode})")
    result = json.loads(done.stdout)
    return result, result["peak_rss_mib"]


def _pyarrow_only(out: Path, scratch: Path) -> float:
    import pyarrow.parquet as pq

    from tracetap.exporters.parquet import ROW_GROUP_ROWS, writer_options

    seconds = 0.0
    for name in ("calls", "trajectories"):
        table = pq.read_table(out / name)
        started = time.perf_counter()
        with pq.ParquetWriter(scratch / f"{name}.parquet", table.schema,
                              **writer_options(table.schema)) as writer:
            writer.write_table(table, row_group_size=ROW_GROUP_ROWS[name])
        seconds += time.perf_counter() - started
        del table
    return seconds


def main() -> None:
    args = _arguments()
    if args.export_only:
        _export_child(args)
        return
    import shutil

    workdir = Path(args.workdir)
    shape = (f"{args.episodes}x{args.turns}x{args.completion_tokens}"
             f"-{args.prompt_tokens}-{args.observation_tokens}")
    db_path = workdir / f"bench-{shape}.db"
    url = f"sqlite:///{db_path}"
    if not db_path.exists():
        workdir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        partial = db_path.with_suffix(".building")
        upgrade(f"sqlite:///{partial}")
        asyncio.run(_build(args, f"sqlite:///{partial}"))
        partial.rename(db_path)
        print(f"built {db_path} ({db_path.stat().st_size / 2**20:.0f} MiB) in "
              f"{time.perf_counter() - started:.1f}s")
    out = workdir / "out"
    scratch = workdir / "pyarrow-only"
    # Rounds alternate export and baseline, so both see the machine in the same moods;
    # the ratio reported is the median of the rounds' ratios.
    rounds = []
    for _ in range(args.rounds):
        for path in (out, scratch):
            shutil.rmtree(path, ignore_errors=True)
        scratch.mkdir(parents=True)
        result, peak_mib = _measure_export(url, out)
        rounds.append((result, peak_mib, _pyarrow_only(out, scratch)))
    ratios = sorted(baseline / result["seconds"] for result, _, baseline in rounds)
    result = sorted((r for r, _, _ in rounds), key=lambda r: r["seconds"])[len(rounds) // 2]
    seconds = result["seconds"]
    written = sum(f.stat().st_size for f in out.rglob("*.parquet"))
    print(json.dumps({
        "episodes": result["episodes"], "call_rows": result["calls"],
        "trajectories": result["trajectories"], "token_ids_written": result["tokens"],
        "rounds": args.rounds,
        "export_seconds_each": [round(r["seconds"], 2) for r, _, _ in rounds],
        "pyarrow_only_seconds_each": [round(b, 2) for _, _, b in rounds],
        "export_seconds_median": round(seconds, 2),
        "tokens_per_second_median": round(result["tokens"] / seconds),
        "peak_rss_mib_max": round(max(peak for _, peak, _ in rounds)),
        "parquet_mib": round(written / 2**20),
        "ratio_pyarrow_only_over_export_each": [round(r, 2) for r in ratios],
        "ratio_pyarrow_only_over_export_median": round(ratios[len(ratios) // 2], 2),
    }, indent=2))

if __name__ == "__main__":
    main()
