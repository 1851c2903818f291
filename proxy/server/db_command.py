"""``tracetap db``: the database's commands: ``upgrade`` (the schema), and the replicas'
leases (``replicas``, ``replay``, ``lost``: storage.replicas, docs/operations.md)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from tracetap.storage import config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="db_command", metavar="SUBCOMMAND")
    parser.set_defaults(print_help=parser.print_help)
    upgrade = commands.add_parser(
        "upgrade", help="create or migrate the schema (Alembic) of --db, or of the SQLite "
                        "database in --data-dir")
    config.add_location_options(upgrade, use="to migrate")
    upgrade.set_defaults(db_run=_upgrade)
    listing = commands.add_parser(
        "replicas", help="each replica's lease: state, seconds since renewed, calls it "
                         "admitted that are not stored yet")
    config.add_location_options(listing, use="to read")
    listing.set_defaults(db_run=_replicas)
    replay = commands.add_parser(
        "replay", help="write a replica's journal directory into the database (a replica "
                       "that will not come back), tombstone what it admitted and never "
                       "journaled, and close its lease")
    replay.add_argument("journal", type=Path, metavar="JOURNAL_DIR",
                        help="the replica's journal directory (its data dir's journal/)")
    replay.add_argument("--force", action="store_true",
                        help="even if its lease was renewed in the last 10 s [default off]")
    config.add_location_options(replay, use="to write into")
    replay.set_defaults(db_run=_replay)
    lost = commands.add_parser(
        "lost", help="give up on a replica that will not come back and whose journal is "
                     "gone: what it admitted and never stored becomes tombstones "
                     "(record_lost, integrity infra) and export stops waiting for it")
    lost.add_argument("replica", help="its id (`tracetap db replicas`)")
    lost.add_argument("--force", action="store_true",
                      help="even if its lease was renewed in the last 10 s [default off]")
    config.add_location_options(lost, use="to write into")
    lost.set_defaults(db_run=_lost)


def run(args: argparse.Namespace) -> int:
    if args.db_command is None:  # `tracetap db` alone: its commands
        args.print_help()
        return 0
    return args.db_run(args)


def _upgrade(args: argparse.Namespace) -> int:
    from tracetap.migrations import revisions, upgrade
    from tracetap.storage.engine import redact_url

    url = config.database_url(args.db, args.data_dir)
    before, head = revisions(url)
    if before == head:
        print(f"schema of {redact_url(url)} is already up to date (revision {head})")
        return 0
    upgrade(url)
    start = "an empty database" if before is None else f"revision {before}"
    print(f"migrated {redact_url(url)} from {start} to revision {head}")
    return 0


def _with_engine(args: argparse.Namespace, work):
    """Run ``work(engine)`` on --db; its errors become one line and exit status 1."""
    from tracetap.storage.engine import create_engine
    from tracetap.storage.replicas import ReplicaRunning

    async def go():
        engine = create_engine(config.database_url(args.db, args.data_dir))
        try:
            return await work(engine)
        finally:
            await engine.dispose()

    try:
        return asyncio.run(go())
    except (ReplicaRunning, LookupError, OSError) as exc:
        print(f"tracetap db {args.db_command}: {exc}", file=sys.stderr)
        return None


def _replicas(args: argparse.Namespace) -> int:
    from tracetap.storage.replicas import status

    rows = _with_engine(args, status)
    if rows is None:
        return 1
    for r in rows:
        print(f"{r.replica}  {r.state}  renewed {r.heartbeat_age:.1f} s ago  "
              f"waiting calls {r.waiting}  journal {r.journal or '-'}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from tracetap.proxy.apis.registry import readers
    from tracetap.storage.replicas import replay

    done = _with_engine(args, lambda e: replay(e, args.journal, force=args.force,
                                               readers=readers()))
    if done is None:
        return 1
    print(f"replayed {done.replayed} records from {args.journal}; {done.tombstones} calls "
          f"it admitted and never journaled stored as tombstones; replica "
          f"{done.replica or '(unnamed journal)'} closed")
    return 0


def _lost(args: argparse.Namespace) -> int:
    from tracetap.storage.replicas import lose

    done = _with_engine(args, lambda e: lose(e, args.replica, force=args.force))
    if done is None:
        return 1
    print(f"replica {done.replica} marked lost; {done.tombstones} calls it admitted and "
          "never stored are tombstones (record_lost): their episodes export as infra")
    return 0
