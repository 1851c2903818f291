"""docs/reference.md, generated from the command line's own definitions so it cannot drift.

    python -m tracetap.reference > docs/reference.md
"""

from __future__ import annotations

import argparse
import sys

from tracetap.cli import build_parser

HEADER = """# Command reference

Generated from the argparse definitions by `python -m tracetap.reference > docs/reference.md`;
`tests/test_startup.py` fails when it is out of date. An option that a `TRACETAP_*`
environment variable sets names it in brackets, with its default; flags win over the
environment.
"""


def render(parser: argparse.ArgumentParser) -> str:
    out = [HEADER]
    _command(out, parser, "tracetap")
    return "\n".join(out) + "\n"


def _command(out: list[str], parser: argparse.ArgumentParser, name: str) -> None:
    options = [a for a in parser._actions if not isinstance(
        a, (argparse._HelpAction, argparse._SubParsersAction))]
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if options:
        out.append(f"## `{name}`\n")
        if parser.description and name != "tracetap":
            out.append(f"{parser.description}\n")
        out.append("| option | what it does |\n| --- | --- |")
        out += [_row(action) for action in options]
        out.append("")
    if not options and parser.description:  # a command of subcommands: what it is for
        out.append(f"## `{name}`\n\n{parser.description}\n")
    for group in subparsers:
        for sub, subparser in group.choices.items():
            _command(out, subparser, f"{name} {sub}")


def _row(action: argparse.Action) -> str:
    """One option's line of the table: its flags, the value it takes, its help."""
    flags = (", ".join(f"`{f}`" for f in action.option_strings)
             or f"`{action.metavar or action.dest}`")
    if action.option_strings and (action.metavar or action.nargs != 0):
        choices = action.choices and "{" + ",".join(map(str, action.choices)) + "}"
        flags += f" {action.metavar or choices or action.dest.upper()}"
    text = (action.help or "").replace("|", "\\|").replace("\n", " ")
    return f"| {flags} | {text} |"


if __name__ == "__main__":
    sys.stdout.write(render(build_parser()))
