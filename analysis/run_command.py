"""``tracetap run``: flags, then the batch (analysis/runner/). Importing this module is
cheap; aiohttp and the runner load only inside ``run``."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from tracetap.storage import config

GROUP = "{run_id}.{task_id}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    config.add_option(
        parser,
        "--proxy",
        default="http://127.0.0.1:8080",
        metavar="URL",
        help="the running proxy whose admin API registers and finishes the episodes (any replica)",
    )
    config.add_option(
        parser,
        "--admin-token",
        metavar="TOKEN",
        help="the proxy's admin token; default: the one in --data-dir (a local proxy's)",
    )
    config.add_option(
        parser,
        "--data-dir",
        metavar="DIR",
        default=config.DEFAULT_DATA_DIR,
        help="where a local proxy keeps its admin token (read when --admin-token is not given)",
    )
    a(
        "--tasks",
        required=True,
        metavar="FILE",
        help="JSONL, one task object a line, each with an id (or task_id)",
    )
    a(
        "--harness",
        required=True,
        metavar="TEMPLATE",
        help="the harness command: {base_url}, {api_key}, {episode}, {group}, {task_id}, "
        "{task.NAME}, {config.NAME}, {repeat}, {run_id} are filled in, each value one "
        "argument; "
        "OPENAI_BASE_URL and ANTHROPIC_BASE_URL are set for it too",
    )
    a(
        "--grader",
        metavar="TEMPLATE",
        help="prints the reward (a number, or JSON {reward, rewards, outcome, info}) as its "
        "last line; the harness's fields and {exit_code}; default: the harness's exit "
        "status (0: reward 1, outcome success; else 0, failure)",
    )
    a(
        "--shell",
        action="store_true",
        help="run the templates with sh -c (values quoted) [default off: no shell]",
    )
    a(
        "--configs",
        metavar="FILE",
        help="JSONL of harness configs, one flat {factor: level} "
        "object a line; each task runs under each config",
    )
    a(
        "--config",
        action="append",
        default=[],
        metavar="K=V,...",
        help="a harness config (repeatable; default: one empty config)",
    )
    a(
        "--harness-name",
        metavar="NAME",
        help="the harness name registered (default: the harness program's name)",
    )
    a(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="episodes per task and config (default 1)",
    )
    a(
        "--concurrency",
        type=int,
        default=4,
        metavar="N",
        help="episodes running at once (default 4)",
    )
    a(
        "--timeout",
        type=float,
        metavar="S",
        help="seconds an episode's harness (and its grader) may run; past it the process "
        "group is killed, outcome timeout, reward 0 (default: none)",
    )
    a(
        "--group",
        default=GROUP,
        metavar="TEMPLATE",
        help=f"the episode's group id (default {GROUP})",
    )
    a(
        "--run-id",
        metavar="NAME",
        help="names the run's episodes; the same id resumes it (default: a hash of the "
        "tasks, configs, harness, grader, repeats and group)",
    )
    a(
        "--logs",
        metavar="DIR",
        help="writes each episode's harness and grader output "
        "to DIR/EPISODE.log (default: discarded)",
    )
    a(
        "--overlay",
        metavar="NAME",
        help="register every episode with this overlay: one the proxy loaded at start, or "
        "a patch installed at run time (docs/overlays.md) [default: none]",
    )
    a(
        "--overlay-file",
        metavar="[NAME=]FILE",
        help="install FILE (a patch: Python source with the hooks) through the admin API, "
        "then register every episode with it; NAME defaults to the file's stem and the "
        "first 8 hex digits of its sha256 (an edited file is a new patch)",
    )
    a("--json", action="store_true", help="the summary as JSON for scripts [default off]")


def run(args: argparse.Namespace) -> int:
    import asyncio

    from tracetap.analysis.runner.admin import AdminError

    try:
        return asyncio.run(_run(args))
    except KeyboardInterrupt:
        print(
            "tracetap run: interrupted; run the same command again to resume "
            "(finished episodes are not rerun)",
            file=sys.stderr,
        )
        return 130
    except AdminError as exc:
        print(f"tracetap run: {exc}", file=sys.stderr)
        return 1


async def _run(args: argparse.Namespace) -> int:
    import msgspec

    from tracetap.analysis.runner import plan
    from tracetap.analysis.runner.admin import AdminClient
    from tracetap.analysis.runner.batch import run_batch
    from tracetap.analysis.runner.episode import Commands, check_templates
    from tracetap.analysis.runner.summary import render, summarise

    if args.overlay and args.overlay_file:
        raise ValueError("--overlay or --overlay-file, not both")
    patch = plan.read_patch(args.overlay_file) if args.overlay_file else None
    overlay = patch[0] if patch else args.overlay
    tasks = plan.read_tasks(args.tasks)
    configs = plan.read_configs(args.configs, args.config)
    run_id = (
        plan.check_run_id(args.run_id)
        if args.run_id
        else plan.default_run_id(
            [t.fields for t in tasks],
            configs,
            args.harness,
            args.grader,
            args.repeats,
            args.group,
            args.shell,
            *([overlay] if overlay else []),  # runs without one keep their ids
        )
    )
    slots = plan.slots(run_id, tasks, configs, args.repeats, args.group)
    commands = Commands(
        harness=args.harness,
        harness_name=args.harness_name or _program(args),
        grader=args.grader,
        shell=args.shell,
        timeout=args.timeout,
        logs=Path(args.logs) if args.logs else None,
        overlay=overlay,
    )
    check_templates(slots, commands)
    print(
        f"tracetap run: run id {run_id}: {len(slots)} episodes ({len(tasks)} tasks x "
        f"{len(configs)} configs x {args.repeats} repeats)",
        file=sys.stderr,
    )
    admin = AdminClient(args.proxy, _token(args))
    try:
        if patch is not None:
            installed = await admin.install_overlay(*patch)
            print(f"tracetap run: overlay {patch[0]} installed (sha256 "
                  f"{installed['sha256'][:12]}, hooks {', '.join(installed['hooks'])})",
                  file=sys.stderr)
        results, elapsed = await run_batch(
            slots, admin, commands, concurrency=args.concurrency, progress_stream=sys.stderr
        )
    finally:
        await admin.close()
    summary = summarise(run_id, configs, results, elapsed)
    print(msgspec.json.encode(summary).decode() if args.json else render(summary))
    return 0


def _token(args: argparse.Namespace) -> str:
    if args.admin_token:
        return args.admin_token
    path = Path(args.data_dir) / "admin-token"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise ValueError(f"no --admin-token, and no {path} (a local proxy's token)") from None


def _program(args: argparse.Namespace) -> str:
    words = shlex.split(args.harness)
    return Path(words[0]).name if words and not args.shell else "harness"
