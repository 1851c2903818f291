"""``tracetap db``: the database schema's commands (today ``db upgrade``)."""

from __future__ import annotations

import argparse

from tracetap.storage import config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="db_command", metavar="SUBCOMMAND")
    parser.set_defaults(print_help=parser.print_help)
    upgrade = commands.add_parser(
        "upgrade", help="create or migrate the schema (Alembic) of --db, or of the SQLite "
                        "database in --data-dir")
    config.add_location_options(upgrade, use="to migrate")
    upgrade.set_defaults(db_run=_upgrade)


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
