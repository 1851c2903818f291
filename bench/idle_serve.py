"""Idle CPU of `tracetap serve` processes, several checkouts and databases at once, so a
change and its baseline are measured over the same seconds of the same machine.

    python bench/idle_serve.py --arm main:/work/main:sqlite --arm mine:.:sqlite \
        --arm main-pg:/work/main:pg --arm mine-pg:.:pg --arm mine-w:.:pg:2 --seconds 30 --reps 3

Each arm is ``label:checkout:sqlite|pg[:workers]``; a checkout runs with its own
``.venv/bin/python`` where it has one. Each proxy gets a fresh migrated database
(Postgres: a throwaway one, bench/pgtemp.py), serves a few calls and sits idle; then
every ``--seconds`` window reads each process tree's CPU from schedstat
(bench/idle_cpu.py), all arms over the same window. Prints ms of CPU per second
(1 ms/s = 0.1% of a core) per window, the minimum and median, and for ``--workers``
each process's own share.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from agentic import wait_ready
from agentic_load import cpu_ns, own_ns, tree
from pgtemp import create_database, drop_database
from proxy_bench import free_port

BENCH = Path(__file__).resolve().parent


def _start(checkout: Path, args: list[str], log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACETAP_")}
    env["PYTHONPATH"] = str(checkout)
    with log.open("wb") as out:
        return subprocess.Popen([_python(checkout), *args], cwd=checkout,
                                env=env, stdout=out, stderr=subprocess.STDOUT)


def _python(checkout: Path) -> str:
    """The checkout's own interpreter (its .venv maps ``tracetap`` to it), else this one."""
    own = checkout / ".venv/bin/python"
    return str(own) if own.exists() else sys.executable


def _call(origin: str) -> None:
    body = json.dumps({"model": "bench-model", "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = urllib.request.Request(origin + "/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        resp.read()


class Arm:
    def __init__(self, spec: str, engine: str, work: Path):
        label, checkout, kind, *workers = spec.split(":")
        self.label, self.checkout = label, Path(checkout).resolve()
        folder = work / label
        folder.mkdir()
        self.db = f"sqlite:///{folder / 'tracetap.db'}" if kind == "sqlite" else create_database()
        subprocess.run([_python(self.checkout), "-c",
                        f"from tracetap.migrations import upgrade; upgrade({self.db!r})"],
                       cwd=self.checkout, check=True)
        port = free_port()
        self.origin = f"http://127.0.0.1:{port}"
        args = ["-m", "tracetap", "--log-level", "WARNING", "serve", "--upstream",
                engine + "/v1", "--port", str(port), "--db", self.db, "--data-dir", str(folder)]
        self.log = folder / "proxy.log"
        self.proc = _start(self.checkout, [*args, *(["--workers", *workers] if workers else [])],
                           self.log)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if self.db.startswith("postgresql"):
            drop_database(self.db)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", action="append", required=True,
                        help="label:checkout:sqlite|pg[:workers]")
    parser.add_argument("--seconds", type=float, default=30.0, help="each window")
    parser.add_argument("--reps", type=int, default=3, help="windows")
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds between the warm-up calls and the first window")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="idle-serve-"))
    engine_port = free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    upstream = _start(BENCH.parent, [str(BENCH / "upstream.py"), "--port", str(engine_port)],
                      work / "engine.log")
    arms: list[Arm] = []
    try:
        wait_ready(engine + "/v1/models", upstream, work / "engine.log")
        arms = [Arm(spec, engine, work) for spec in args.arm]
        for arm in arms:
            wait_ready(arm.origin + "/healthz", arm.proc, arm.log)
            for _ in range(4):  # --workers: most likely both workers served one
                _call(arm.origin)
        time.sleep(args.settle)
        shares: dict[str, list[float]] = {arm.label: [] for arm in arms}
        own: dict[str, dict[int, float]] = {}
        for rep in range(args.reps):
            start = {arm.label: cpu_ns([arm.proc.pid]) for arm in arms}
            each = {arm.label: {p: own_ns(p) for p in tree(arm.proc.pid)} for arm in arms}
            began = time.perf_counter()
            time.sleep(args.seconds)
            wall = time.perf_counter() - began
            for arm in arms:
                shares[arm.label].append((cpu_ns([arm.proc.pid]) - start[arm.label]) / 1e6 / wall)
                own[arm.label] = {p: (own_ns(p) - v) / 1e6 / wall
                                  for p, v in each[arm.label].items()}
            print(f"window {rep}: " + "  ".join(f"{label}={values[-1]:.2f}"
                                               for label, values in shares.items()), flush=True)
        print(f"\nidle CPU, ms per s over {args.reps} x {args.seconds:g} s "
              "(1 ms/s = 0.1% of a core)")
        for arm in arms:
            values = shares[arm.label]
            processes = "  ".join(f"{v:.2f}" for v in own[arm.label].values()) \
                if len(own[arm.label]) > 1 else ""
            print(f"{arm.label:20s} min {min(values):6.2f}  median {statistics.median(values):6.2f}"
                  + (f"   per process (supervisor first): {processes}" if processes else ""))
    finally:
        for arm in arms:
            arm.stop()
        upstream.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
