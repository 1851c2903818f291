"""``tracetap export``: flags, a progress bar on a terminal, one summary line at the end.

Importing this module is cheap (no pyarrow, no SQLAlchemy): the CLI builds its parser
for every subcommand, and ``tracetap serve`` should not pay for the exporter.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from typing import TextIO

from tracetap.exporters.report import missing_note, summary_line
from tracetap.storage import config

DATASET_CHOICES = ("calls", "trajectories", "all")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--out", required=True, metavar="DIR",
      help="output directory: DIR/calls/ and DIR/trajectories/ Parquet datasets; or a URI "
           "such as s3://bucket/prefix (docs/export.md)")
    add_storage_arguments(parser)
    add_selection_arguments(parser)
    a("--dataset", choices=DATASET_CHOICES, default="all",
      help="which dataset to write: calls/ (one row per call and choice), trajectories/ "
           "(training rows) or both [default all]")
    a("--incremental", action="store_true",
      help="append only episodes finished since the last run (watermark in "
           "DIR/_manifest.json) [default off]")
    a("--overwrite", action="store_true", help="replace an existing export in DIR [default off]")
    a("--keep-untokenized", action="store_true",
      help="keep calls without token ids in trajectories/ as single-turn rows marked "
           "split_reason=no_token_ids (not training data; the adapters refuse them) "
           "[default off]")
    a("--exclude-infra", action="store_true",
      help="leave out episodes whose integrity is infra (an upstream failure, a refusal, a "
           "lost record...: docs/export.md) and say how many [default off]")
    a("--metrics-file", metavar="FILE",
      help="write this run's tracetap_trajectory_splits_total{cause} in Prometheus text "
           "format (for node_exporter's textfile collector)")
    a("--no-progress", dest="progress", action="store_false",
      help="no progress bar (it is shown only on a terminal anyway) [default: shown]")


def add_selection_arguments(parser: argparse.ArgumentParser) -> None:
    """The database and which of its episodes: the same flags wherever episodes are read
    (export, packets, compare, harnesses), so a selection means the same thing."""
    a = parser.add_argument
    config.add_location_options(parser, use="to read")
    a("--since", type=timestamp, metavar="TIME",
      help="episodes created at or after TIME (ISO 8601, UTC if no zone; or epoch seconds)")
    a("--until", type=timestamp, metavar="TIME", help="episodes created before TIME")
    a("--episode", action="append", default=[], metavar="ID",
      help="only this episode (repeatable); ids not found or not finished are named, and "
           "nothing is written when none is left")
    a("--group", metavar="ID", help="only episodes of this group")
    a("--finished-only", action=argparse.BooleanOptionalAction, default=True,
      help="only episodes finished with POST /tracetap/episodes/{id}/finish; "
           "--no-finished-only reads unfinished ones too [default on]")


def database_url(args: argparse.Namespace) -> str:
    return config.database_url(args.db, args.data_dir)


def add_storage_arguments(parser: argparse.ArgumentParser) -> None:
    """How to reach an object store; credentials come only from the environment."""
    parser.add_argument(
        "--s3-endpoint", default=None, metavar="URL",
        help="S3-compatible server for s3:// (MinIO, Ceph...; default: AWS_ENDPOINT_URL, "
             "else AWS). Credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY")


def run(args: argparse.Namespace) -> int:
    from tracetap.exporters.pipeline import ExportError, export  # pyarrow is loaded only from here

    db = database_url(args)
    datasets = ("calls", "trajectories") if args.dataset == "all" else (args.dataset,)
    bar = ProgressBar(sys.stderr) if args.progress and sys.stderr.isatty() else None
    try:
        summary = export(
            db, args.out, since=args.since, until=args.until, episodes=args.episode,
            group=args.group, finished_only=args.finished_only, datasets=datasets,
            incremental=args.incremental, overwrite=args.overwrite,
            keep_untokenized=args.keep_untokenized, exclude_infra=args.exclude_infra,
            progress=bar.update if bar else None,
            s3_endpoint=args.s3_endpoint,
        )
    except ExportError as exc:
        print(f"tracetap export: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if bar is not None:
            bar.close()
    print(summary_line(summary, summary.out))
    if summary.not_found or summary.not_finished:
        print(f"tracetap export: not exported: "
              f"{missing_note(summary.not_found, summary.not_finished)}", file=sys.stderr)
    if args.exclude_infra:
        print(f"left out: {summary.excluded_infra} episodes with integrity infra "
              "(--exclude-infra)")
    if summary.held:
        print(f"held for a later run: {summary.held} episodes whose calls are not all "
              "stored yet (a replica's journal; `tracetap db replicas`)", file=sys.stderr)
    if summary.annotations:
        print(f"annotations/: {summary.annotations} annotations (every one, rewritten each run)")
    if args.metrics_file:
        write_metrics(args.metrics_file, summary.splits)
    if summary.left_out:
        why = ", ".join(f"{reason}: {n}" for reason, n in sorted(summary.left_out.items()))
        print(f"left out of trajectories/: {sum(summary.left_out.values())} completions "
              f"without token ids ({why}); the proxy logged the remedy for each reason "
              "(docs/fidelity.md); --keep-untokenized keeps them as marked rows")
    return 0


def write_metrics(path: str, splits: dict[str, int]) -> None:
    """The run's splits by cause as a Prometheus counter, written atomically."""
    from prometheus_client import CollectorRegistry, Counter, write_to_textfile

    registry = CollectorRegistry()
    counter = Counter("tracetap_trajectory_splits_total", "Trajectory rows off their "
                      "episode's main line in this export, by cause (docs/fidelity.md)",
                      ["cause"], registry=registry)
    for cause, count in splits.items():
        counter.labels(cause).inc(count)
    write_to_textfile(path, registry)


def timestamp(text: str) -> float:
    """ISO 8601 (naive means UTC) or epoch seconds → epoch seconds."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"not a time: {text!r} (use ISO 8601 like 2025-01-31T12:00:00Z, or epoch seconds)"
        ) from exc
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


class ProgressBar:
    """One redrawn line on a terminal, at most ten times a second."""

    WIDTH = 24

    def __init__(self, stream: TextIO):
        self.stream = stream
        self._last = 0.0
        self._drawn = False

    def update(self, p) -> None:
        now = time.monotonic()
        if now - self._last < 0.1 and p.episodes < p.episodes_total:
            return
        self._last = now
        total = max(p.episodes_total, 1)
        filled = min(self.WIDTH, self.WIDTH * p.episodes // total)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        self.stream.write(
            f"\r[{bar}] {p.episodes}/{p.episodes_total} episodes  {p.calls} calls  "
            f"{p.trajectories} trajectories  {p.tokens / 1e6:.1f}M tokens  {p.seconds:.1f}s")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
