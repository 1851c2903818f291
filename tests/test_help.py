"""`--help` of every command: each option explained, with its default and its TRACETAP_*
variable, in plain text. The argparse tree is walked, so a new option cannot skip this."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from tracetap.cli import build_parser
from tracetap.storage.config import variable

# Read after parsing, by settings_from_args (repeatable, or required), not as a default.
# Options whose variable is not their flag's: --no-search-index is TRACETAP_SEARCH_INDEX=0.
NAMED_OTHERWISE = {"--no-search-index": ("TRACETAP_SEARCH_INDEX", "0")}
READ_AFTER_PARSING = {"TRACETAP_UPSTREAM", "TRACETAP_ALLOW_PATH", "TRACETAP_MODEL_MAP",
                      "TRACETAP_OVERLAY", "TRACETAP_ALLOW_REQUEST_FIELD",
                      "TRACETAP_POLICY_MODEL"}


def _commands(parser: argparse.ArgumentParser, name: str = "tracetap"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from _commands(subparser, f"{name} {sub}")


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every option and positional of every command, by "command flag"."""
    return {
        f"{name} {(a.option_strings or [a.dest])[-1]}": a
        for name, p in _commands(parser)
        for a in p._actions
        if not isinstance(
            a, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)
        )
    }


def test_every_command_is_walked():
    names = {name for name, _ in _commands(build_parser())}
    assert {
        "tracetap serve",
        "tracetap export",
        "tracetap drift",
        "tracetap db",
        "tracetap db upgrade",
        "tracetap ui",
        "tracetap demo",
        "tracetap admin-token",
        "tracetap mock-engine",
        "tracetap packets",
        "tracetap compare",
        "tracetap harnesses",
        "tracetap quarantine list",
        "tracetap quarantine show",
    } <= names


def test_every_option_has_help_and_states_its_default():
    for where, action in _options(build_parser()).items():
        assert action.help and action.help.split("[")[0].strip(), f"{where}: no help"
        has_default = action.default not in (None, [], argparse.SUPPRESS)
        if action.option_strings and has_default:
            assert "default" in action.help, f"{where}: default {action.default!r} not shown"


def test_help_is_plain_text_without_restructuredtext_markup():
    rst = re.compile(r"``|:(option|ref|func|class|mod|envvar):`")
    for name, parser in _commands(build_parser()):
        assert not rst.search(parser.format_help()), f"{name} --help has RST markup"


def _sample(action: argparse.Action) -> str:
    """A value for the option's variable that differs from its built-in default."""
    if action.nargs == 0:
        return "1"
    if action.choices:
        return next(c for c in reversed(action.choices) if c != action.default)
    return {int: "7", float: "7.5"}.get(action.type, "sample-value")


def test_every_option_a_variable_sets_names_it_and_every_named_variable_sets_it(monkeypatch):
    for name in [n for n in __import__("os").environ if n.startswith("TRACETAP_")]:
        monkeypatch.delenv(name)
    plain = _options(build_parser())
    for action in plain.values():
        for flag in action.option_strings:
            monkeypatch.setenv(*NAMED_OTHERWISE.get(flag, (variable(flag), _sample(action))))
    changed = _options(build_parser())
    assert changed.keys() == plain.keys()
    backed = {where for where in plain if plain[where].default != changed[where].default}
    assert {
        "tracetap serve --port",
        "tracetap --log-level",
        "tracetap export --db",
        "tracetap db upgrade --data-dir",
        "tracetap ui --admin-token",
    } <= backed
    for where, action in plain.items():
        named = set(re.findall(r"TRACETAP_[A-Z_]+[A-Z]", action.help or ""))
        own = {NAMED_OTHERWISE.get(f, (variable(f),))[0] for f in action.option_strings}
        if where in backed:
            assert named == own, f"{where}: its help should name {own}, names {named}"
        else:  # naming a variable that does nothing would mislead
            assert named <= READ_AFTER_PARSING & own, f"{where} names {named} in vain"


def test_the_variables_read_after_parsing_do_set_their_options(monkeypatch):
    from tracetap.proxy.server.serve_flags import settings_from_args

    monkeypatch.setenv("TRACETAP_UPSTREAM", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("TRACETAP_ALLOW_PATH", "/health, /version")
    monkeypatch.setenv("TRACETAP_MODEL_MAP", "claude-*=qwen")
    monkeypatch.setenv("TRACETAP_ALLOW_REQUEST_FIELD", "priority, cache_salt")
    monkeypatch.setenv("TRACETAP_POLICY_MODEL", "qwen, qwen-lora")
    settings = settings_from_args(build_parser().parse_args(["serve"]))
    assert settings.policy_model == ["qwen", "qwen-lora"]
    assert settings.upstream == ["http://127.0.0.1:9/v1"]
    assert settings.allow_path == ["/health", "/version"]
    assert settings.model_map == ["claude-*=qwen"]
    assert settings.allow_request_field == ["priority", "cache_salt"]


@pytest.mark.parametrize("command", [["db"], ["db", "--help"]])
def test_db_alone_prints_its_subcommands(command):
    result = subprocess.run(
        [sys.executable, "-m", "tracetap", *command], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "upgrade" in result.stdout and "create or migrate the schema" in result.stdout
