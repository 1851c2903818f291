"""The tracetap command: serve, admin-token, db upgrade, export, prune, drift, quarantine,
packets, compare, harnesses, ui, demo, mock-engine."""

from __future__ import annotations

import argparse
import logging
import sys

from tracetap import __version__
from tracetap.proxy.settings import add_serve_arguments, settings_from_args
from tracetap.storage import config

log = logging.getLogger("tracetap")


def build_parser() -> argparse.ArgumentParser:
    """Every command and option; docs/reference.md is generated from this."""
    parser = argparse.ArgumentParser(
        prog="tracetap", description="Capture an agent's model calls with their token ids "
        "and logprobs, and export them as Parquet for RL trainers. Flags win over the "
        "TRACETAP_* variable each names.")
    parser.add_argument("--version", action="version", version=f"tracetap {__version__}",
                        help="print the version and exit")
    config.add_option(parser, "--log-level", default="INFO", metavar="LEVEL",
                      help="DEBUG, INFO, WARNING or ERROR")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the capture proxy")
    add_serve_arguments(serve)
    serve.set_defaults(run=_serve)

    token = commands.add_parser("admin-token", help="print the admin token that serve "
                                "generated in --data-dir (for scripts: TOKEN=$(tracetap ...))")
    config.add_option(token, "--data-dir", metavar="DIR", default=config.DEFAULT_DATA_DIR,
                      help=config.DATA_DIR_HELP)
    token.set_defaults(run=_admin_token)

    db = commands.add_parser("db", help="database schema: tracetap db upgrade")
    db_commands = db.add_subparsers(dest="db_command", metavar="SUBCOMMAND")
    db.set_defaults(run=lambda _: db.print_help() or 0)  # `tracetap db` alone: its commands
    upgrade = db_commands.add_parser(
        "upgrade", help="create or migrate the schema (Alembic) of --db, or of the SQLite "
                        "database in --data-dir")
    config.add_location_options(upgrade, use="to migrate")
    upgrade.set_defaults(run=_db_upgrade)

    # Each command's module has add_arguments(parser) and run(args); importing one is cheap
    # (pyarrow, the servers and the database load only in its run).
    from tracetap.analysis import command as analysis_command
    from tracetap.demo import engine_command
    from tracetap.demo import runner as demo_runner
    from tracetap.exporters import command as export_command
    from tracetap.exporters import drift_command, prune_command
    from tracetap.proxy import ui_command
    from tracetap.storage import quarantine_command

    for name, module, help_text in (
        ("export", export_command, "write episodes as Parquet for RL trainers"),
        ("prune", prune_command, "delete from the database the episodes an export proves "
                                 "written (--exported OUT; --dry-run)"),
        ("drift", drift_command, "why an export's trajectories split: per cause, harness and "
                                 "episode (a table, or --json)"),
        ("quarantine", quarantine_command, "records the database refused, kept in "
                                           "--data-dir's dead-letter files: list, show"),
    ):
        _add_command(commands, name, module, help_text)
    analysis_command.add_packets_arguments(commands.add_parser(
        "packets", help="failed episodes as failure packets for a harness-editing model"))
    analysis_command.add_compare_arguments(commands.add_parser(
        "compare", help="Δ_B of harness variants on the same tasks, with intervals"))
    analysis_command.add_harnesses_arguments(commands.add_parser(
        "harnesses", help="harness-factor coverage, and a balanced set of configurations"))
    for name, module, help_text in (
        ("ui", ui_command, "browse a database in the trace viewer, without a running proxy"),
        ("demo", demo_runner, "the whole loop locally, no GPU: mock engine, proxy, scripted "
                              "openai-SDK agent, Parquet export"),
        ("mock-engine", engine_command, "run the deterministic vLLM-like test engine (no GPU, "
                                        "no model)"),
    ):
        _add_command(commands, name, module, help_text)
    _describe(parser)
    return parser


def _add_command(commands, name: str, module, help_text: str) -> None:
    sub = commands.add_parser(name, help=help_text)
    module.add_arguments(sub)
    sub.set_defaults(run=module.run)


def _describe(parser: argparse.ArgumentParser) -> None:
    """A command's help line is also what its own --help says it does."""
    for group in parser._actions:
        if isinstance(group, argparse._SubParsersAction):
            for choice in group._choices_actions:
                sub = group.choices[choice.dest]
                sub.description = sub.description or choice.help
                _describe(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    try:
        return args.run(args) or 0
    except (ValueError, OSError) as exc:
        print(f"tracetap: error: {exc}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace) -> int:
    from tracetap.migrations import prepare_schema
    from tracetap.proxy import serve
    from tracetap.proxy.admin_token import ensure_admin_token
    from tracetap.proxy.app import build_app
    from tracetap.proxy.startup_check import check_upstreams

    settings = settings_from_args(args)
    check_upstreams(settings.upstreams, settings.upstream_api_key)
    prepare_schema(settings.database_url)
    if settings.admin_token:
        token_note = "admin token from --admin-token"
    else:
        token_note = f"admin token in {ensure_admin_token(settings.data_dir)[1]}"
    if settings.workers > 1:
        from tracetap.proxy import workers

        return workers.supervise(settings, args.log_level, token_note)
    app = build_app(settings)
    # Bound before anything is announced: a port in use fails here, with its number.
    sockets, admin_at = serve.listeners(settings)
    print(announcement(settings, admin_at, token_note), flush=True)
    serve.run(app, sockets, settings)
    return 0


def announcement(settings, admin_at: str, token_note: str) -> str:
    from tracetap.storage.engine import redact_url

    upstreams = ", ".join(spec.shown for spec in settings.upstreams)
    journal = f"journal {settings.journal_dir}"
    if settings.workers > 1:
        journal = (f"{settings.workers} workers, journals {settings.journal_dir}, "
                   f"{settings.worker_journal(1).name}, ...")
    return (f"tracetap {__version__} listening on http://{settings.host}:{settings.port} "
            f"-> upstream {upstreams}; storing in {redact_url(settings.database_url)} "
            f"({journal}); admin API on {admin_at}, {token_note}")


def _admin_token(args: argparse.Namespace) -> int:
    from tracetap.proxy.admin_token import read_admin_token, token_path

    token = read_admin_token(args.data_dir)
    if token is None:
        raise ValueError(f"no admin token at {token_path(args.data_dir)}: start "
                         "`tracetap serve` with this --data-dir once, or pass --admin-token")
    print(token)
    return 0


def _db_upgrade(args: argparse.Namespace) -> int:
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




if __name__ == "__main__":
    sys.exit(main())
