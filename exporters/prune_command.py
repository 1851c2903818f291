"""``tracetap prune --exported OUT``: flags and one summary line.

Importing this module is cheap (no pyarrow, no SQLAlchemy), like ``exporters.command``.
"""

from __future__ import annotations

import argparse
import sys

from tracetap.exporters.command import add_storage_arguments
from tracetap.storage import config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--exported", required=True, metavar="OUT",
      help="an export (the --out of tracetap export: a directory or s3://bucket/prefix); "
           "only rows its manifest and ledgers list are deleted")
    config.add_location_options(parser, use="to prune")
    a("--dry-run", action="store_true",
      help="delete nothing; print what would be pruned [default off]")
    add_storage_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from tracetap.exporters.prune import ExportError, prune_exported  # pyarrow loads only from here

    db = config.database_url(args.db, args.data_dir)
    try:
        summary = prune_exported(db, args.exported, dry_run=args.dry_run,
                                 s3_endpoint=args.s3_endpoint, readers=args.readers())
    except ExportError as exc:
        print(f"tracetap prune: error: {exc}", file=sys.stderr)
        return 1
    print(describe(summary))
    return 0


def describe(summary) -> str:
    c = summary.counts
    kept = (f"kept: {c.kept_running} still running, {c.kept_refinished} finished again since "
            f"the export, {c.kept_late_calls} with calls stored after it")
    if summary.runs_without_ledger:
        kept += (f"; {summary.runs_without_ledger} runs without a ledger (older tracetap) "
                 "trusted for nothing")
    verb = "dry run: would prune" if summary.dry_run else "pruned"
    return (f"{verb} {c.episodes} episodes: {c.calls} calls, {c.choices} choices, "
            f"{c.annotations} annotations, "
            f"{c.blocks} blocks no call references any more ({kept}) "
            f"proven by {summary.exported} in {summary.seconds:.1f}s")
