"""``tracetap packets``, ``compare`` and ``harnesses``: flags, then one call each.

Importing this module is cheap (the CLI builds every subcommand's parser); the storage
layer loads only inside ``run``. Episodes are chosen with export's own flags.
"""

from __future__ import annotations

import argparse
import sys

from tracetap.exporters.command import add_selection_arguments, database_url


def add_packets_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a(
        "--out",
        required=True,
        metavar="DIR",
        help="writes DIR/packets.jsonl and DIR/packets.parquet (and DIR/batches.jsonl)",
    )
    _common(parser)
    a(
        "--failure",
        action="append",
        metavar="WHY",
        choices=("unsuccessful", "call_error", "context_length"),
        help="what makes an episode failed (repeatable; default: all three)",
    )
    a(
        "--steps",
        type=int,
        default=5,
        metavar="K",
        help="the last K action-observation steps in each packet (default 5)",
    )
    a(
        "--max-chars",
        type=int,
        default=2000,
        metavar="N",
        help="cut each text to N characters, head and tail around a marker (default 2000)",
    )
    a(
        "--batch",
        metavar="KEY",
        help="group packets by task batch: a selector key (group, task, meta.NAME, "
        "config.NAME, ...); writes DIR/batches.jsonl",
    )
    a("--where", metavar="SELECTOR", help="only episodes matching SELECTOR")
    a(
        "--per-batch",
        type=int,
        metavar="N",
        help="at most N packets per batch (per --batch; of all without it), the first by "
        "task and episode: the sparse setting, a few failures at a time (default: all)",
    )
    parser.set_defaults(run=_packets)


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--baseline", required=True, metavar="SELECTOR", help="e.g. 'harness=A'")
    a(
        "--candidate",
        action="append",
        required=True,
        metavar="SELECTOR",
        help="e.g. 'harness=B' or 'config.retries=3' or 'overlay=NAME' (repeatable: K "
        "candidates get group-normalised advantages)",
    )
    _common(parser)
    a(
        "--resamples",
        type=int,
        default=2000,
        metavar="N",
        help="paired bootstrap resamples (default 2000)",
    )
    a("--seed", type=int, default=0, help="the bootstrap's seed (default 0)")
    a(
        "--allow-unpaired",
        action="store_true",
        help="drop tasks only one side ran (default: an error)",
    )
    a("--seen-task", action="append", default=[], metavar="TASK",
      help="a task the candidates were written from (a failure packet's; repeatable): "
           "Δ_B is also reported on the held-out tasks, the paired ones outside these")
    a("--invalid", action="append", default=[], metavar="LABEL",
      help="a candidate that never ran (invalid patch; repeatable): it enters the "
           "advantages' group with --penalty, as the trainer computes them")
    a("--penalty", type=float, default=-1.0, help="an invalid candidate's reward (default -1)")
    a("--reward", choices=("in-batch", "held-out"),
      help="the Δ_B the advantages use (default: held-out when --seen-task leaves every "
           "candidate a held-out task, else in-batch)")
    a("--json", action="store_true", help="JSON for scripts instead of a table [default off]")
    parser.set_defaults(run=_compare)


def add_harnesses_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    _common(parser)
    a(
        "--factor",
        action="append",
        default=[],
        metavar="NAME",
        help="only this factor of the harness config (repeatable; default: all, or the space's)",
    )
    a("--where", metavar="SELECTOR", help="only episodes matching SELECTOR")
    a(
        "--space",
        metavar="FILE",
        help="the factor space: YAML or JSON mapping factor -> list of levels",
    )
    a(
        "--select",
        type=int,
        metavar="N",
        help="propose N configurations covering the space's level pairs evenly (needs --space)",
    )
    a(
        "--held-out",
        action="append",
        default=[],
        metavar="SELECTOR",
        help="report success on the episodes SELECTOR matches (held-out configs, e.g. "
        "config.context=window) against the rest: overall, per level, per task "
        "(repeatable: any of them)",
    )
    a(
        "--held-out-file",
        metavar="FILE",
        help="held-out configs too: JSONL (or a JSON list) of flat {factor: level} objects",
    )
    a("--json", action="store_true", help="JSON for scripts instead of a table [default off]")
    parser.set_defaults(run=_harnesses)


def _common(parser: argparse.ArgumentParser) -> None:
    add_selection_arguments(parser)
    a = parser.add_argument
    a(
        "--success-outcome",
        action="append",
        metavar="OUTCOME",
        help="outcomes that are a success (repeatable; default: success)",
    )
    a(
        "--threshold",
        type=float,
        default=1.0,
        help="otherwise a success is reward >= THRESHOLD (default 1.0)",
    )


def _packets(args: argparse.Namespace) -> int:
    from tracetap.analysis.packets import FAILURES, Options, build, write

    def go():
        options = Options(
            success=_success(args),
            failures=tuple(args.failure or FAILURES),
            steps=args.steps,
            max_chars=args.max_chars,
            batch=args.batch,
            where=_selector(args.where),
            per_batch=args.per_batch,
        )
        if options.batch:
            from tracetap.analysis.select import check_key

            check_key(options.batch, "--batch")
        result = build(database_url(args), _filter(args), options)
        files = write(args.out, result)
        why = ", ".join(f"{r}: {n}" for r, n in result.reasons.items())
        print(
            f"{len(result.packets)} failure packets of {result.episodes} episodes ({why}) "
            f"-> {', '.join(str(f) for f in files)}"
        )
        if len(result.packets) < result.failed:
            print(f"--per-batch {args.per_batch}: {result.failed - len(result.packets)} more "
                  "failed episodes left out")
        if result.infra:
            print(f"no packet for {result.infra} episodes with integrity infra (an upstream "
                  "failure, a refusal, a lost record: not the harness's doing)")

    return _guarded("packets", go)


def _compare(args: argparse.Namespace) -> int:
    from tracetap.analysis.compare import compare, render
    from tracetap.analysis.episodes import load

    def go():
        baseline = _selector(args.baseline)
        candidates = [_selector(c) for c in args.candidate]
        policies = any(s.needs_policies for s in (baseline, *candidates))
        episodes = load(database_url(args), _filter(args), policies=policies, costs=True)
        result = compare(
            episodes,
            baseline,
            candidates,
            success=_success(args),
            resamples=args.resamples,
            seed=args.seed,
            allow_unpaired=args.allow_unpaired,
            seen_tasks=frozenset(args.seen_task),
            invalid=args.invalid,
            penalty=args.penalty,
            reward=args.reward,
        )
        _show(result, render, args.json)

    return _guarded("compare", go)


def _harnesses(args: argparse.Namespace) -> int:
    from tracetap.analysis.coverage import coverage, render
    from tracetap.analysis.design import cover, read_space
    from tracetap.analysis.episodes import AnalysisError, load

    def go():
        if args.select is not None and not args.space:
            raise AnalysisError("--select needs --space FILE (the factors and their levels)")
        space = read_space(args.space) if args.space else None
        where = _selector(args.where)
        episodes = load(
            database_url(args), _filter(args), policies=bool(where and where.needs_policies)
        )
        if where is not None:
            episodes = [e for e in episodes if where.matches(e)]
        report = coverage(episodes, success=_success(args), factors=args.factor, space=space)
        if args.select is not None:
            report.design = cover(space, args.select)
        if args.held_out or args.held_out_file:
            report.held_out = _held_out(args, episodes, report)
        _show(report, render, args.json)

    return _guarded("harnesses", go)


def _held_out(args: argparse.Namespace, episodes, report):
    from tracetap.analysis.held_out import Chooser, held_out, read_configs

    chooser = Chooser(
        selectors=tuple(_selector(text) for text in args.held_out),
        configs=read_configs(args.held_out_file) if args.held_out_file else (),
    )
    levels: dict[str, list[str]] = {}
    for row in report.levels:
        levels.setdefault(row.factor, []).append(row.level)
    return held_out(episodes, chooser, success=_success(args), factors=report.factors,
                    levels=levels)


def _guarded(name: str, go) -> int:
    from tracetap.analysis.episodes import AnalysisError

    try:
        go()
    except AnalysisError as exc:
        print(f"tracetap {name}: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _show(result, render, as_json: bool) -> None:
    if as_json:
        import msgspec

        print(msgspec.json.format(msgspec.json.encode(result, order="sorted")).decode())
    else:
        print(render(result))


def _selector(text: str | None):
    from tracetap.analysis.select import parse_selector

    return None if text is None else parse_selector(text)


def _success(args: argparse.Namespace):
    from tracetap.analysis.select import Success

    return Success(outcomes=tuple(args.success_outcome or ("success",)), threshold=args.threshold)


def _filter(args: argparse.Namespace):
    from tracetap.storage.scan import EpisodeFilter

    return EpisodeFilter(
        since=args.since,
        until=args.until,
        episode_ids=tuple(sorted(set(args.episode))),
        group_id=args.group,
        finished_only=args.finished_only,
    )
