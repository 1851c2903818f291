"""What every command is told the same way, read in one place: TRACETAP_* variables, the
data directory and the database URL.

It lives in storage because every package may import storage and nothing else
(docs/architecture.md), and because where the database is, is storage's question.
Flags win over variables: a variable only changes an option's default.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

PREFIX = "TRACETAP_"
DEFAULT_DATA_DIR = "./tracetap-data"
DATABASE_FILE = "tracetap.db"


def variable(option: str) -> str:
    """The variable of an option: ``--data-dir`` or ``data_dir`` → ``TRACETAP_DATA_DIR``."""
    return PREFIX + option.lstrip("-").upper().replace("-", "_")


def env(option: str, default: str | None = None) -> str | None:
    return os.environ.get(variable(option), default)


def env_flag(option: str, default: bool = False) -> bool:
    value = env(option)
    return default if value is None else value.lower() in ("1", "true", "yes", "on")


SEARCH_INDEX_VARIABLE = variable("search_index")  # --no-search-index: 0 turns it off


def search_index() -> bool:
    """Whether the viewer's full-text search index is kept (TRACETAP_SEARCH_INDEX, on
    unless 0/false/no/off): the writer indexes calls, the search page searches text."""
    return env_flag("search_index", True)


def env_list(option: str) -> list[str]:
    """A repeatable option's variable: a comma-separated list."""
    return [p.strip() for p in (env(option) or "").split(",") if p.strip()]


def database_url(db: str | None, data_dir: str | os.PathLike) -> str:
    """``--db`` when given, else the SQLite file in the data directory (made absolute, so
    the URL means the same from any directory)."""
    if db:
        return db
    return f"sqlite:///{Path(data_dir).resolve() / DATABASE_FILE}"


def described(text: str, *, var: str | None = None, default: object = None) -> str:
    """Help ``text`` ending with its variable and default: ``text [TRACETAP_X; default Y]``."""
    notes = [n for n in (var, None if default in (None, [], "") else f"default {default}") if n]
    return f"{text.rstrip()} [{'; '.join(notes)}]" if notes else text


def add_option(
    parser: argparse.ArgumentParser, flag: str, *, help: str, default: object = None, **kw
) -> argparse.Action:
    """``add_argument`` for an option whose default its TRACETAP_* variable changes; the
    help names the variable and the built-in default (a string from the variable goes
    through ``type`` like a flag's value)."""
    text = described(help, var=variable(flag), default=default)
    return parser.add_argument(flag, help=text, default=env(flag, default), **kw)


def db_help(use: str) -> str:
    """``--db``'s help; ``use`` says what the command does with the database."""
    return (
        f"database {use}: postgresql://user@host/db (postgres:// too) or "
        "sqlite:///path.db; default: the SQLite file in --data-dir"
    )


DATA_DIR_HELP = (
    "where tracetap keeps the SQLite database (tracetap.db), the journal and the "
    "admin token; relative to the current directory"
)


def add_location_options(parser: argparse.ArgumentParser, *, use: str) -> None:
    """``--db`` and ``--data-dir``, the same for every command that opens the database."""
    add_option(parser, "--db", metavar="URL", help=db_help(use))
    add_option(parser, "--data-dir", metavar="DIR", default=DEFAULT_DATA_DIR, help=DATA_DIR_HELP)


def redact_credentials(url: str) -> str:
    """``http://user:pass@host/v1`` → ``http://***@host/v1``: nothing of the userinfo."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))
