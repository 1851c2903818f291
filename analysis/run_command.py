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
        "--space",
        metavar="FILE",
        help="assign configs from a harness-factor space (YAML or JSON factor -> levels) "
        "instead: each task meets --configs-per-task of them, every level pair covered, "
        "level counts balanced, on top of what the harness already ran",
    )
    a(
        "--configs-per-task",
        type=int,
        default=2,
        metavar="N",
        help="with --space: configs each task runs under (default 2)",
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
    from tracetap.analysis.runner import plan
    from tracetap.analysis.runner.admin import AdminClient
    from tracetap.analysis.runner.space_plan import space_identity

    if args.overlay and args.overlay_file:
        raise ValueError("--overlay or --overlay-file, not both")
    patch = plan.read_patch(args.overlay_file) if args.overlay_file else None
    overlay = patch[0] if patch else args.overlay
    tasks = plan.read_tasks(args.tasks)
    space = _space(args)
    configs = [] if space else plan.read_configs(args.configs, args.config)
    # With --space, the space and the count decide what runs (the configs come from the
    # proxy's basis, which a rerun reads as the first run saw it).
    chosen = [space_identity(space), args.configs_per_task] if space else configs
    run_id = (
        plan.check_run_id(args.run_id)
        if args.run_id
        else plan.default_run_id(
            [t.fields for t in tasks],
            chosen,
            args.harness,
            args.grader,
            args.repeats,
            args.group,
            args.shell,
            *([overlay] if overlay else []),  # runs without one keep their ids
        )
    )
    harness_name = args.harness_name or _program(args)
    admin = AdminClient(args.proxy, _token(args))
    try:
        return await _run_slots(
            args, tasks, space, configs, run_id, harness_name, admin, overlay, patch
        )
    finally:
        await admin.close()


async def _run_slots(
    args, tasks, space, configs, run_id, harness_name, admin, overlay, patch
) -> int:
    import msgspec

    from tracetap.analysis.runner import plan
    from tracetap.analysis.runner.batch import run_batch
    from tracetap.analysis.runner.episode import Commands, check_templates
    from tracetap.analysis.runner.space_plan import render_report, space_slots
    from tracetap.analysis.runner.summary import render, summarise

    report = None
    if space:
        slots, report = await space_slots(
            admin, space, tasks, per_task=args.configs_per_task, repeats=args.repeats,
            group=args.group, run_id=run_id, harness_name=harness_name,
        )
        configs = _distinct(s.config for s in slots)
    else:
        slots = plan.slots(run_id, tasks, configs, args.repeats, args.group)
    commands = Commands(
        id_secret=_token(args),
        harness=args.harness,
        harness_name=harness_name,
        grader=args.grader,
        shell=args.shell,
        timeout=args.timeout,
        logs=Path(args.logs) if args.logs else None,
        overlay=overlay,
    )
    check_templates(slots, commands)
    shape = (
        f"{args.configs_per_task} configs per task" if space else f"{len(configs)} configs"
    )
    print(
        f"tracetap run: run id {run_id}: {len(slots)} episodes ({len(tasks)} tasks x "
        f"{shape} x {args.repeats} repeats)",
        file=sys.stderr,
    )
    if report is not None:
        print(f"tracetap run: {render_report(report)}", file=sys.stderr)
    if patch is not None:
        installed = await admin.install_overlay(*patch)
        print(f"tracetap run: overlay {patch[0]} installed (sha256 "
              f"{installed['sha256'][:12]}, hooks {', '.join(installed['hooks'])})",
              file=sys.stderr)
    results, elapsed = await run_batch(
        slots, admin, commands, concurrency=args.concurrency, progress_stream=sys.stderr
    )
    summary = summarise(run_id, configs, results, elapsed, by_value=space is not None)
    summary.space = report
    print(msgspec.json.encode(summary).decode() if args.json else render(summary))
    return 0


def _space(args: argparse.Namespace):
    from tracetap.analysis.design import read_space
    from tracetap.analysis.episodes import AnalysisError

    if not args.space:
        return None
    if args.configs or args.config:
        raise ValueError("--space assigns the configs: give it without --configs/--config")
    try:
        return read_space(args.space)
    except AnalysisError as exc:  # a bad file is bad input (status 2), like a bad --tasks
        raise ValueError(str(exc)) from None


def _distinct(configs) -> list:
    """Each config once, in the order of first use."""
    from tracetap.analysis.runner.plan import digest

    seen: dict[str, dict] = {}
    for c in configs:
        seen.setdefault(digest(c), c)
    return list(seen.values())


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
