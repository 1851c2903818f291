"""The admin token: given by the operator, or generated once and kept in the data dir.

There is no tokenless admin API, not even on loopback: agents often run on the same
host (or in sandboxes sharing its network), and an open admin API would let one grade
itself, pause generation for everyone or change the policy version.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

FILE_NAME = "admin-token"


def token_path(data_dir: str | Path) -> Path:
    return Path(data_dir) / FILE_NAME


def read_admin_token(data_dir: str | Path) -> str | None:
    try:
        token = token_path(data_dir).read_text().strip()
    except FileNotFoundError:
        return None
    return token or None


def new_token() -> str:
    """A random token that does not start with '-': one that did (1 in 64) would read as
    an option where a command takes ``--admin-token TOKEN``."""
    while (token := secrets.token_urlsafe(32)).startswith("-"):
        pass
    return token


def ensure_admin_token(data_dir: str | Path) -> tuple[str, Path]:
    """The stored token, or a new one written readable by this user only."""
    path = token_path(data_dir)
    token = read_admin_token(data_dir)
    if token is not None:
        return token, path
    path.parent.mkdir(parents=True, exist_ok=True)
    token = new_token()
    # O_EXCL: two processes starting at once agree on the first token written.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        existing = read_admin_token(data_dir)
        if existing is None:
            raise ValueError(
                f"{path} exists but is empty: remove it or pass --admin-token") from None
        return existing, path
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    return token, path
