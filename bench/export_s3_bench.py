"""Export to object storage vs local disk, same data, same run.

    python bench/export_s3_bench.py                  # 2,000 episodes x 8 turns x 256 tokens
    python bench/export_s3_bench.py --episodes 500   # a quick run
    python bench/export_s3_bench.py --postgres       # the database in a fresh Postgres

Builds (or reuses) export_bench.py's synthetic SQLite database, starts moto's standalone
S3 server on this machine (``pip install 'moto[server]'``), then alternates, for
--rounds rounds: a full export to a local directory, and the same export to
``s3://bench/round-N``. Reports each round's seconds, the medians and the ratio
s3 / local; then the time of ``prune --dry-run`` reading the S3 export's ledgers, and of
the real prune (on a copy of the SQLite file, or the throwaway Postgres database).
moto is a Python server sharing this machine's cores: a real S3 endpoint has other costs
(network, latency per request), so read the ratio as the exporter's overhead on a store
without rename, not as S3's speed.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import export_bench  # noqa: E402
import pgtemp  # noqa: E402

from tracetap.exporters import export  # noqa: E402
from tracetap.exporters.prune import prune_exported  # noqa: E402
from tracetap.migrations import upgrade  # noqa: E402


def _moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                "-p", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
            return process, endpoint
        except OSError:
            time.sleep(0.1)
    raise SystemExit("moto server did not start")


def main() -> None:
    postgres = "--postgres" in sys.argv
    sys.argv = [a for a in sys.argv if a != "--postgres"]
    sys.argv += [] if any(a.startswith("--episodes") for a in sys.argv) else ["--episodes",
                                                                               "2000"]
    args = export_bench._arguments()
    url = _database(args, postgres)
    try:
        figures = _measure(args, url, postgres)
    finally:
        if postgres:
            pgtemp.drop_database(url)
    print(json.dumps({"database": "postgres" if postgres else "sqlite", **figures}, indent=2))


def _database(args, postgres: bool) -> str:
    if postgres:
        url = pgtemp.create_database()
        upgrade(url)
        asyncio.run(export_bench._build(args, url))
        return url
    workdir = Path(args.workdir)
    shape = (f"{args.episodes}x{args.turns}x{args.completion_tokens}"
             f"-{args.prompt_tokens}-{args.observation_tokens}")
    db_path = workdir / f"bench-{shape}.db"
    if not db_path.exists():
        workdir.mkdir(parents=True, exist_ok=True)
        partial = db_path.with_suffix(".building")
        upgrade(f"sqlite:///{partial}")
        asyncio.run(export_bench._build(args, f"sqlite:///{partial}"))
        partial.rename(db_path)
    return f"sqlite:///{db_path}"


def _measure(args, url: str, postgres: bool) -> dict:
    workdir = Path(args.workdir)
    process, endpoint = _moto()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint,
                      AWS_EC2_METADATA_DISABLED="true")
    try:
        import pyarrow.fs as pafs

        pafs.S3FileSystem(endpoint_override=endpoint,
                          allow_bucket_creation=True).create_dir("bench")
        local, remote = [], []
        for n in range(args.rounds):
            out = workdir / "s3-bench-local"
            shutil.rmtree(out, ignore_errors=True)
            local.append(export(url, out))
            remote.append(export(url, f"s3://bench/round-{n}"))
        last = f"s3://bench/round-{args.rounds - 1}"
        started = time.perf_counter()
        pruned = prune_exported(url, last, dry_run=True)
        dry_seconds = time.perf_counter() - started
        victim = url
        if not postgres:  # prune a copy: the built database is reused by later runs
            copy = workdir / "s3-bench-prune.db"
            shutil.copyfile(url.removeprefix("sqlite:///"), copy)
            victim = f"sqlite:///{copy}"
        started = time.perf_counter()
        really = prune_exported(victim, last)
        prune_seconds = time.perf_counter() - started
    finally:
        process.terminate()
        process.wait(10)
    seconds = lambda runs: sorted(r.seconds for r in runs)  # noqa: E731
    ratios = sorted(r.seconds / lo.seconds for r, lo in zip(remote, local))
    return {
        "episodes": local[0].episodes, "calls": local[0].calls,
        "token_ids_written": local[0].tokens, "rounds": args.rounds,
        "local_seconds_each": [round(r.seconds, 2) for r in local],
        "s3_seconds_each": [round(r.seconds, 2) for r in remote],
        "local_seconds_median": round(seconds(local)[len(local) // 2], 2),
        "s3_seconds_median": round(seconds(remote)[len(remote) // 2], 2),
        "ratio_s3_over_local_median": round(ratios[len(ratios) // 2], 2),
        "prune_dry_run_seconds": round(dry_seconds, 2),
        "prune_dry_run_episodes": pruned.counts.episodes,
        "prune_seconds": round(prune_seconds, 2),
        "prune_calls_per_second": round(really.counts.calls / prune_seconds),
        "pruned_same_as_dry_run": really.counts == pruned.counts,
        "same_rows_everywhere": all((r.episodes, r.call_rows, r.trajectories, r.tokens)
                                    == (local[0].episodes, local[0].call_rows,
                                        local[0].trajectories, local[0].tokens)
                                    for r in (*local, *remote)),
    }


if __name__ == "__main__":
    main()
