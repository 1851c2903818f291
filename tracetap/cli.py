"""The tracetap command: each package's commands, composed (docs/architecture.md).

This is the one module that sees every package: the packages keep their own commands'
code (``add_arguments(parser)`` and ``run(args)``, or an ``add_*_arguments`` that sets
its own ``run``), so none of them imports upward to be on the command line. Importing a
command's module is cheap: pyarrow, the servers and the database load only in its run.
"""

from __future__ import annotations

import argparse
import logging
import sys

from tracetap import __version__
from tracetap.analysis import command as analysis_command
from tracetap.analysis import engineer_command, run_command
from tracetap.demo import engine_command
from tracetap.demo import runner as demo_runner
from tracetap.exporters import command as export_command
from tracetap.exporters import drift_command, prune_command
from tracetap.proxy.admin import token_command as admin_token_command
from tracetap.proxy.admin import ui_command
from tracetap.proxy.server import db_command, serve_command
from tracetap.storage import config, quarantine_command

# (name, what it does, the module with add_arguments and run), in --help's order.
COMMANDS = (
    ("serve", "run the capture proxy", serve_command),
    ("admin-token", "print the admin token that serve generated in --data-dir (for scripts: "
                    "TOKEN=$(tracetap ...))", admin_token_command),
    ("db", "database schema: tracetap db upgrade", db_command),
    ("export", "write episodes as Parquet for RL trainers", export_command),
    ("prune", "delete from the database the episodes an export proves written (--exported "
              "OUT; --dry-run)", prune_command),
    ("drift", "why an export's trajectories split: per cause, harness and episode (a table, "
              "or --json)", drift_command),
    ("quarantine", "records the database refused, kept in --data-dir's dead-letter files: "
                   "list, show", quarantine_command),
    ("packets", "failed episodes as failure packets for a harness-editing model",
     analysis_command.add_packets_arguments),
    ("compare", "Δ_B of harness variants on the same tasks, with intervals",
     analysis_command.add_compare_arguments),
    ("harnesses", "harness-factor coverage, and a balanced set of configurations",
     analysis_command.add_harnesses_arguments),
    ("run", "a batch of tasks through a harness, each an episode graded and finished; "
            "resumable", run_command),
    ("engineer", "an engineer model patches the harness per failure packet; each patch's "
                 "reward is its Δ_B (Harness-R1)", engineer_command),
    ("ui", "browse a database in the trace viewer, without a running proxy", ui_command),
    ("demo", "the whole loop locally, no GPU: mock engine, proxy, scripted openai-SDK agent, "
             "Parquet export", demo_runner),
    ("mock-engine", "run the deterministic vLLM-like test engine (no GPU, no model)",
     engine_command),
)


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
    # What reads a stored call's conversation, and where each API's request holds it
    # (analysis commands; prune's search postings): composed here, as the packages below
    # the proxy may not import it; loaded only when a command asks.
    parser.set_defaults(readers=conversation_readers)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text, command in COMMANDS:
        sub = commands.add_parser(name, help=help_text)
        if callable(command):  # an add_*_arguments that sets its own run
            command(sub)
        else:
            command.add_arguments(sub)
            sub.set_defaults(run=command.run)
    _describe(parser)
    return parser


def conversation_readers():
    """Each wire API's conversation reader and request shape
    (``storage.conversation.Readers``)."""
    from tracetap.proxy.apis.registry import readers

    return readers()


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


if __name__ == "__main__":
    sys.exit(main())
