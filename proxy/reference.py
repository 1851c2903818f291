"""docs/reference.md, generated from the command line's own definitions so it cannot drift.

    python -m tracetap.proxy.reference > docs/reference.md
"""

from __future__ import annotations

import argparse
import sys

from tracetap.proxy.cli import build_parser

HEADER = """# Command reference

Generated from the argparse definitions by `python -m tracetap.proxy.reference > docs/reference.md`;
`tests/test_startup.py` fails when it is out of date. Every `tracetap serve` option also
reads a `TRACETAP_*` environment variable (flags win over the environment).
"""


def render(parser: argparse.ArgumentParser) -> str:
    out = [HEADER]
    _command(out, parser, "tracetap")
    return "\n".join(out) + "\n"


def _command(out: list[str], parser: argparse.ArgumentParser, name: str) -> None:
    options = [a for a in parser._actions
               if a.option_strings and not isinstance(a, argparse._HelpAction)]
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if options:
        out.append(f"## `{name}`\n")
        if parser.description and name != "tracetap":
            out.append(f"{parser.description}\n")
        out.append("| option | what it does |\n| --- | --- |")
        for action in options:
            flags = ", ".join(f"`{f}`" for f in action.option_strings)
            if action.metavar or action.nargs != 0:
                flags += f" {action.metavar or action.dest.upper()}"
            text = (action.help or "").replace("|", "\\|").replace("\n", " ")
            out.append(f"| {flags} | {text} |")
        out.append("")
    for group in subparsers:
        helps = {c.dest: c.help for c in group._choices_actions}
        for sub, subparser in group.choices.items():
            if not subparser.add_help:  # mock-engine passes its own options through
                out.append(f"## `{name} {sub}`\n\n{helps.get(sub) or ''}; "
                           f"`{name} {sub} --help` lists its options.\n")
                continue
            subparser.description = subparser.description or helps.get(sub)
            _command(out, subparser, f"{name} {sub}")


if __name__ == "__main__":
    sys.stdout.write(render(build_parser()))
