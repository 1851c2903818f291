"""``tracetap quarantine list|show``: the records the database refused, read from the
dead-letter files in ``--data-dir`` (``storage.quarantine``); no database needed."""

from __future__ import annotations

import argparse
import datetime
import json

import msgspec

from tracetap.storage import config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="quarantine_command", metavar="SUBCOMMAND")
    parser.set_defaults(print_help=parser.print_help)
    listing = sub.add_parser("list", help="one line per kept record: when, kind (refused: "
                             "not stored; altered: stored with values replaced), call, "
                             "episode, reason")
    config.add_option(listing, "--data-dir", metavar="DIR", default=config.DEFAULT_DATA_DIR,
                      help=config.DATA_DIR_HELP)
    listing.set_defaults(quarantine_run=run_list)
    show = sub.add_parser("show", help="one kept record as JSON, decoded as it was captured")
    show.add_argument("call_id", metavar="CALL_ID", help="a call id from `quarantine list`")
    config.add_option(show, "--data-dir", metavar="DIR", default=config.DEFAULT_DATA_DIR,
                      help=config.DATA_DIR_HELP)
    show.set_defaults(quarantine_run=run_show)


def run(args: argparse.Namespace) -> int:
    if args.quarantine_command is None:  # `tracetap quarantine` alone: its commands
        args.print_help()
        return 0
    return args.quarantine_run(args)


def run_list(args: argparse.Namespace) -> int:
    from tracetap.storage.quarantine import directory_of, read_all

    entries = read_all(args.data_dir)
    if not entries:
        print(f"nothing quarantined in {directory_of(args.data_dir)}")
        return 0
    for e in entries:
        when = datetime.datetime.fromtimestamp(e.quarantined_at, datetime.timezone.utc)
        print("\t".join([when.isoformat(timespec="seconds"), e.kind, e.call_id,
                         json.dumps(e.episode_id)[:80], e.reason]))
    refused = sum(e.kind == "refused" for e in entries)
    print(f"{len(entries)} records: {refused} refused (not stored), "
          f"{len(entries) - refused} stored altered")
    return 0


def run_show(args: argparse.Namespace) -> int:
    from tracetap.storage.quarantine import read_all

    for e in read_all(args.data_dir):
        if e.call_id == args.call_id:
            try:  # untyped: a record that no longer fits CallRecord shows as it is
                record = msgspec.msgpack.decode(e.record)
            except msgspec.DecodeError:  # not msgpack at all: its bytes
                record = None
            out = {**msgspec.to_builtins(e), "record": record}
            if record is None:
                out["record_bytes_base64"] = msgspec.to_builtins(e)["record"]
            print(json.dumps(out, indent=2, ensure_ascii=True))
            return 0
    raise ValueError(f"no quarantined record {args.call_id} in {args.data_dir}")
