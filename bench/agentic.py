"""Agentic replay: long sessions through tracetap vs direct, cost per turn by context.

    python bench/agentic.py                      # 8 sessions x 30 turns x 2000 + 400 tokens
    python bench/agentic.py --rounds 3 --arms direct pg pg-workers --workers 2
    python bench/agentic.py --sessions 2 --turns 3 --tool 50 --out 20 --rounds 1   # smoke
    python bench/agentic.py --rounds 1 --arms direct relay sqlite pg --paced 0.005
                                                 # and again with a paced engine: every row

Sessions of ``turns`` turns each add a ``tool``-token tool result and stream ``out`` tokens
with logprobs and token ids from a vLLM-shaped engine (bench/agentic_engine.py, its own
process, its cost flat in context), the context growing to ``system + turns * (tool +
out)``. Arms run one after another, the order rotating each round, each tracetap arm on a
fresh database: ``direct`` (no proxy, the ceiling), ``relay`` (bench/relay.py, a bare
aiohttp relay that forwards bytes and captures nothing: the ceiling of any Python proxy on
this machine), ``sqlite``, ``pg`` and ``pg-workers`` (Postgres with ``serve --workers
N``). In each arm the load generator (its own process, bench/agentic_load.py) runs two
warm-up turns, one session alone (the proxy's CPU per turn read from /proc after its
writer settles) and then ``sessions`` sessions at once.

Printed per arm, medians over rounds: throughput kept (completion tokens/s vs direct),
proxy CPU per turn by context bucket (one session alone), added TTFT by bucket (alone and
concurrent), database bytes per unique token and stored token ids per unique token (the
database read after the arm), proxy RSS growth per million context tokens in flight;
and the checks: every call the load generator made is in the database with its tokens,
and the client got byte-for-byte what direct gets. Each proxy's idle CPU is read for
``--idle-seconds`` after its warm-up. With ``--paced S`` the arms run again against an
engine paced at S seconds a token, and the figures of both runs are printed beside the
relay's, one row per target (bench/agentic_targets.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agentic_load import cpu_ns
from agentic_report import ArmRun, print_report
from agentic_shape import Session, Sizes
from agentic_store import database_figures, empty_database, stored_ids_match
from agentic_targets import print_targets
from idle_cpu import idle_ms_per_s
from proxy_bench import free_port, spawn, stop

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
ARMS = ("direct", "relay", "sqlite", "pg", "pg-workers")


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited early:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout}s:\n{log.read_text()[-3000:]}")


def load(args: argparse.Namespace, base: str, sessions: list[int], mode: str, pids: list[int],
         prefix: str, turns: int | None = None) -> dict:
    cmd = [sys.executable, str(BENCH / "agentic_load.py"), "--base", base, "--mode", mode,
           "--client", args.client, "--turns", str(turns or args.turns),
           "--tool", str(args.tool), "--out", str(args.out), "--system", str(args.system),
           "--sessions", *map(str, sessions)]
    if prefix:
        cmd += ["--episode-prefix", prefix]
    if pids:
        cmd += ["--pids", *map(str, pids)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=BENCH,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def metric(origin: str, name: str) -> float:
    with urllib.request.urlopen(origin + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def drain(origin: str, expected: int, timeout: float = 120.0) -> None:
    """Until the writer has committed (or dropped) every call made."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = metric(origin, 'tracetap_records_total{outcome="written"}') + \
            metric(origin, 'tracetap_records_total{outcome="dropped"}')
        if done >= expected:
            return
        time.sleep(0.2)


def run_arm(args: argparse.Namespace, arm: str, engine_origin: str, engine_pid: int,
            work: Path, n: str) -> ArmRun:
    sessions = list(range(args.sessions))
    single, warm = args.sessions, args.sessions + 1
    proc, db, origin = None, None, engine_origin
    log = work / f"{arm}-{n}.log"
    try:
        if arm == "relay":  # the ceiling of any proxy on this machine: bytes, nothing else
            port = free_port()
            origin = f"http://127.0.0.1:{port}"
            proc = spawn([str(BENCH / "relay.py"), "--port", str(port), "--upstream",
                          engine_origin], log)
            wait_ready(origin + "/v1/models", proc, log)
        elif arm != "direct":
            db, empty = empty_database(arm, work / f"{arm}-{n}")
            port = free_port()
            origin = f"http://127.0.0.1:{port}"
            workers = ["--workers", str(args.workers)] if arm == "pg-workers" else []
            proc = spawn(["-m", "tracetap", "--log-level", "WARNING", "serve", "--upstream",
                          engine_origin + "/v1", "--port", str(port), "--db", db,
                          "--data-dir", str(work / f"{arm}-{n}"), *workers], log)
            wait_ready(origin + "/healthz", proc, log)
        pids = [proc.pid] if proc is not None else []
        prefix = "agentic" if db is not None else ""
        load(args, origin, [warm], "single", [], prefix, turns=min(2, args.turns))
        idle = None
        if pids and args.idle_seconds > 0:
            time.sleep(1.0)  # the warm-up's writes settle
            idle = idle_ms_per_s(pids, args.idle_seconds)
        alone = load(args, origin, [single], "single", pids, prefix)
        engine0 = cpu_ns([engine_pid])
        together = load(args, origin, sessions, "concurrent", pids, prefix)
        together["engine_cpu"] = (cpu_ns([engine_pid]) - engine0) / 1e9
        run = ArmRun(arm, alone, together)
        run.extra["idle_ms_s"] = idle
        if db is not None:
            calls = (args.sessions + 1) * args.turns + min(2, args.turns)
            drain(origin, calls)
            stop(proc)
            run.store = database_figures(arm, db, empty)
            sizes = Sizes(args.sessions + 2, args.turns, args.tool, args.out, args.system)
            run.store["ids_match"] = stored_ids_match(db, f"agentic-{single}",
                                                      Session(sizes, single))
            run.calls_expected = calls
            run.unique_tokens = (sizes.unique_tokens(args.sessions + 1)
                                 + min(2, args.turns) * (args.tool + args.out))
        return run
    finally:
        stop(proc)
        if db is not None and db.startswith("postgresql"):
            from pgtemp import drop_database

            drop_database(db)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8, help="sessions run at once")
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--tool", type=int, default=2000, help="tokens of each tool result")
    parser.add_argument("--out", type=int, default=400, help="tokens streamed per turn")
    parser.add_argument("--system", type=int, default=1000,
                        help="tokens of the system prompt every session shares")
    parser.add_argument("--token-delay", type=float, default=0.0,
                        help="the engine's seconds between a stream's events (0: as fast as "
                             "it can, so the run is CPU-bound; e.g. 0.02 paces it like a "
                             "50 tokens/s engine, below saturation)")
    parser.add_argument("--paced", type=float, default=None, metavar="SECONDS",
                        help="then run the arms again against an engine paced at this many "
                             "seconds a token (e.g. 0.005), and print both runs' rows beside "
                             "the relay's")
    parser.add_argument("--idle-seconds", type=float, default=4.0,
                        help="each proxy's idle CPU is read this long after its warm-up")
    parser.add_argument("--rounds", type=int, default=2,
                        help="each arm runs once a round, the order rotating")
    parser.add_argument("--arms", nargs="+", choices=ARMS,
                        default=["direct", "relay", "sqlite", "pg"])
    parser.add_argument("--workers", type=int, default=2, help="serve --workers of pg-workers")
    parser.add_argument("--client", choices=("plain", "rl"), default="plain",
                        help="plain: the agent asks for nothing (tracetap injects logprobs, "
                             "token ids and usage, and strips them); rl: it asks itself")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args(argv)
    if "direct" not in args.arms:
        args.arms.insert(0, "direct")

    work = Path(tempfile.mkdtemp(prefix="tracetap-agentic-"))
    load0 = os.getloadavg()
    runs = replay(args, work, args.token_delay)
    figures = print_report(runs, args, load0, os.getloadavg())
    paced = None
    if args.paced:
        print(f"\npaced: the engine sends a token every {args.paced * 1e3:g} ms")
        load0 = os.getloadavg()
        paced = print_report(replay(args, work, args.paced), args, load0, os.getloadavg())
        figures["paced"] = paced
        figures["checks_pass"] &= paced["checks_pass"]
    figures["targets"] = print_targets(figures, paced, args.paced)
    if args.keep_logs:
        print(f"logs in {work}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0 if figures["checks_pass"] else 1


def replay(args: argparse.Namespace, work: Path, token_delay: float) -> list[ArmRun]:
    """Every round of every arm against one engine paced at ``token_delay``."""
    port = free_port()
    engine_origin = f"http://127.0.0.1:{port}"
    log = work / f"engine-{token_delay:g}.log"
    engine = spawn([str(BENCH / "agentic_engine.py"), "--port", str(port),
                    "--sessions", str(args.sessions + 2), "--turns", str(args.turns),
                    "--tool", str(args.tool), "--out", str(args.out),
                    "--system", str(args.system), "--token-delay", str(token_delay)],
                   log)
    runs: list[ArmRun] = []
    try:
        wait_ready(engine_origin + "/v1/models", engine, log, timeout=600)
        for r in range(args.rounds):
            order = args.arms[r % len(args.arms):] + args.arms[: r % len(args.arms)]
            print(f"round {r + 1}/{args.rounds}: {', '.join(order)}", flush=True)
            for arm in order:
                runs.append(run_arm(args, arm, engine_origin, engine.pid, work,
                                    f"{token_delay:g}-{r}"))
                runs[-1].round = r
    finally:
        stop(engine)
    return runs


if __name__ == "__main__":
    sys.exit(main())

