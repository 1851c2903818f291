"""``tracetap engineer``: flags, then the loop (analysis/engineer/). Importing this module
is cheap; aiohttp and the loop load only inside ``run``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tracetap.storage import config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    config.add_option(
        parser,
        "--proxy",
        default="http://127.0.0.1:8080",
        metavar="URL",
        help="the proxy the target harness's batches run through (its admin API)",
    )
    config.add_option(
        parser,
        "--admin-token",
        metavar="TOKEN",
        help="that proxy's admin token; default: the one in --data-dir",
    )
    config.add_option(
        parser,
        "--data-dir",
        metavar="DIR",
        default=config.DEFAULT_DATA_DIR,
        help="where a local proxy keeps its admin token and, without --db, its SQLite database",
    )
    config.add_option(
        parser,
        "--db",
        metavar="URL",
        help="the database the proxies write (packets and Δ_B are read from "
        "it); default: the SQLite file in --data-dir",
    )
    a(
        "--engineer-proxy",
        metavar="URL",
        help="the proxy the engineer model is called through (default: --proxy); its "
        "upstream serves --model, and it must write to the same database",
    )
    a("--engineer-admin-token", metavar="TOKEN", help="its admin token (default: --admin-token's)")
    a("--model", required=True, metavar="NAME", help="the engineer model's name")
    a("--tasks", required=True, metavar="FILE", help="the batch B: JSONL, as tracetap run's")
    a("--harness", required=True, metavar="TEMPLATE", help="as tracetap run's")
    a("--grader", metavar="TEMPLATE", help="as tracetap run's (default: the exit status)")
    a("--shell", action="store_true", help="as tracetap run's [default off]")
    a("--harness-name", metavar="NAME", help="as tracetap run's")
    a("--repeats", type=int, default=1, metavar="N", help="episodes per task (default 1)")
    a("--concurrency", type=int, default=4, metavar="N", help="episodes at once (default 4)")
    a("--timeout", type=float, metavar="S", help="seconds per episode (default: none)")
    a(
        "--run-id",
        required=True,
        metavar="NAME",
        help="names everything this loop registers: RUN-base (the baseline), RUN-pSHA (the "
        "batch with a patch), RUN-gSHA (its guard set), RUN.PACKET.cK (engineer episodes)",
    )
    a(
        "-k",
        "--candidates",
        type=int,
        default=4,
        metavar="K",
        help="candidate patches per packet (a GRPO group; default 4)",
    )
    a("--reward", choices=("in-batch", "held-out"),
      help="the Δ_B a valid candidate's episode is rewarded with: on the whole batch, or on "
           "the held-out tasks (those not in the packets it was written from; default: "
           "held-out when the batch has such tasks, else in-batch; docs/harness-engineering.md)")
    a(
        "--penalty",
        type=float,
        default=-1.0,
        help="the reward of an invalid patch (no patch, does not load, a hook fails on the "
        "packet's calls, breaks a guard task); default -1",
    )
    a(
        "--guard",
        type=int,
        default=2,
        metavar="N",
        help="tasks the baseline solved that a patch is first run on; breaking one makes it "
        "invalid (default 2)",
    )
    a(
        "--hook-budget",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds each hook may take on a packet's recorded calls (default 2)",
    )
    a(
        "--max-tokens",
        type=int,
        default=4096,
        metavar="N",
        help="max_tokens of each engineer call: the patch must fit in it, and the packets' "
        "prompt plus N in the engineer model's context (default 4096)",
    )
    a(
        "--batch-packets",
        action="store_true",
        help="ask once for all packets (one group) instead of once per packet [default off]",
    )
    a(
        "--max-packets",
        type=int,
        metavar="N",
        help="use the first N packets only (the sparse setting; default: all)",
    )
    a(
        "--scripted",
        metavar="FILE",
        help="testing aid, mock engine only: a JSON list of texts; candidate k's engineer "
        "call asks the engine for text k (mock_content) instead of sampling",
    )
    a("--logs", metavar="DIR", help="each episode's harness and grader output")
    a("--json", action="store_true", help="the candidates as JSON [default off]")


def run(args: argparse.Namespace) -> int:
    import asyncio

    from tracetap.analysis.episodes import AnalysisError
    from tracetap.analysis.runner.admin import AdminError

    try:
        return asyncio.run(_run(args))
    except (AdminError, AnalysisError) as exc:
        print(f"tracetap engineer: {exc}", file=sys.stderr)
        return 1


async def _run(args: argparse.Namespace) -> int:
    import msgspec

    from tracetap.analysis.engineer.loop import Options, engineer
    from tracetap.analysis.engineer.table import render
    from tracetap.analysis.run_command import _program, _token
    from tracetap.analysis.runner import plan
    from tracetap.analysis.runner.admin import AdminClient
    from tracetap.analysis.runner.episode import Commands

    if args.candidates < 1:
        raise ValueError("-k/--candidates must be at least 1")
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    plan.check_run_id(args.run_id)
    scripted = tuple(
        msgspec.json.decode(Path(args.scripted).read_bytes(), type=list[str])
        if args.scripted
        else ()
    )
    options = Options(
        run_id=args.run_id,
        model=args.model,
        candidates=args.candidates,
        penalty=args.penalty,
        reward=args.reward,
        guard=args.guard,
        hook_budget=args.hook_budget,
        max_tokens=args.max_tokens,
        batch_packets=args.batch_packets,
        max_packets=args.max_packets,
        concurrency=args.concurrency,
        repeats=args.repeats,
        scripted=scripted,
    )
    commands = Commands(
        harness=args.harness,
        harness_name=args.harness_name or _program(args),
        grader=args.grader,
        shell=args.shell,
        timeout=args.timeout,
        logs=Path(args.logs) if args.logs else None,
    )
    token = _token(args)
    admin = AdminClient(args.proxy, token)
    engineer_admin = AdminClient(
        args.engineer_proxy or args.proxy, args.engineer_admin_token or token
    )
    try:
        rows = await engineer(
            config.database_url(args.db, args.data_dir),
            plan.read_tasks(args.tasks),
            commands,
            options,
            admin,
            engineer_admin,
            readers=args.readers(),
        )
    finally:
        await admin.close()
        await engineer_admin.close()
    print(msgspec.json.encode(rows).decode() if args.json else render(rows, args.penalty))
    return 0
