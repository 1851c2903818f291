"""The command line composed at the top (tracetap/cli.py) is the same command line the
proxy's own cli.py was: the same subcommands, in the same order, with the same help
lines, run by the installed `tracetap` script and by `python -m tracetap`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

# `tracetap --help` before the command line moved out of proxy/, in its order,
# and the commands added since where they were added (`run`, `engineer`: after
# harnesses).
BEFORE = ["serve", "admin-token", "db", "export", "prune", "drift", "quarantine", "packets",
          "compare", "harnesses", "run", "engineer", "ui", "demo", "mock-engine"]


def _listed(help_text: str) -> list[str]:
    """The subcommands `--help` lists under COMMAND, in order."""
    block = help_text.split("COMMAND\n", 1)[1].split("\noptions:", 1)[0]
    return re.findall(r"^    (\S+)", block, flags=re.M)


def test_tracetap_help_lists_the_same_subcommands_as_before():
    script = Path(sys.executable).with_name("tracetap")
    for command in ([str(script)], [sys.executable, "-m", "tracetap"]):
        shown = subprocess.run([*command, "--help"], capture_output=True, text=True,
                               timeout=60, env={"COLUMNS": "200", "PATH": ""})
        assert shown.returncode == 0, shown.stderr
        assert _listed(shown.stdout) == BEFORE, command


def test_each_subcommand_runs_its_own_packages_code():
    """Composition only: a subcommand's run is its package's function, so the packages
    keep their commands and the top adds no behaviour of its own."""
    import argparse

    from tracetap.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    owners = {
        "serve": "tracetap.proxy.", "admin-token": "tracetap.proxy.",
        "export": "tracetap.exporters.", "prune": "tracetap.exporters.",
        "drift": "tracetap.exporters.", "packets": "tracetap.analysis.",
        "compare": "tracetap.analysis.", "harnesses": "tracetap.analysis.",
        "run": "tracetap.analysis.", "engineer": "tracetap.analysis.",
        "ui": "tracetap.proxy.", "demo": "tracetap.demo.", "mock-engine": "tracetap.demo.",
    }
    for name, owner in owners.items():
        run = commands.choices[name].get_default("run")
        assert run.__module__.startswith(owner), (name, run.__module__)
    db = parser.parse_args(["db", "upgrade"])
    assert db.run.__module__ == "tracetap.proxy.server.db_command" and db.db_command == "upgrade"
