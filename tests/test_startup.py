"""What `tracetap serve` says at start about the common mistakes, in one line."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from helpers.loop import free_port


def _serve(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tracetap", "serve", "--data-dir", str(tmp_path / "d"),
         "--port", str(free_port()), *args],
        capture_output=True, text=True, timeout=60)


def test_an_upstream_without_v1_is_refused_with_the_url_to_pass(engine, tmp_path):
    origin = engine.url.removesuffix("/v1")
    result = _serve(tmp_path, "--upstream", origin)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == (f"tracetap: error: --upstream {origin} serves the OpenAI API under "
                         f"/v1: pass --upstream {origin}/v1")


def test_a_port_in_use_fails_before_anything_is_announced(engine, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "tracetap", "serve", "--upstream", engine.url,
             "--data-dir", str(tmp_path / "d"), "--port", str(port)],
            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "listening on" not in result.stdout
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracetap", *args], capture_output=True,
                          text=True, timeout=120)


def test_db_upgrade_says_what_it_did(fresh_postgres):
    first = _cli("db", "upgrade", "--db", fresh_postgres.replace("postgresql://", "postgres://"))
    assert first.returncode == 0, first.stderr
    assert "migrated" in first.stdout and "from an empty database to revision" in first.stdout
    again = _cli("db", "upgrade", "--db", fresh_postgres)
    assert "already up to date" in again.stdout


def test_a_database_url_that_cannot_be_parsed_is_echoed_with_its_password_masked(tmp_path):
    result = _cli("db", "upgrade", "--db", "postgresql://me:s3cret@host:notaport/db")
    assert result.returncode == 2
    assert "s3cret" not in result.stderr and "me:***@host:notaport/db" in result.stderr


def test_db_upgrade_migrates_the_database_in_the_data_dir_it_is_given(tmp_path, monkeypatch):
    monkeypatch.delenv("TRACETAP_DB", raising=False)
    monkeypatch.setenv("TRACETAP_DATA_DIR", str(tmp_path / "from-the-environment"))
    result = _cli("db", "upgrade", "--data-dir", str(tmp_path / "given"))
    assert result.returncode == 0, result.stderr
    database = (tmp_path / "given" / "tracetap.db").resolve()
    assert result.stdout.startswith(f"migrated sqlite:///{database} from an empty database")
    assert not (tmp_path / "from-the-environment").exists()
    again = _cli("db", "upgrade", "--data-dir", str(tmp_path / "given"))
    assert "already up to date" in again.stdout


def test_the_command_reference_is_up_to_date():
    from pathlib import Path

    from tracetap.cli import build_parser
    from tracetap.reference import render

    written = (Path(__file__).parent.parent / "docs" / "reference.md").read_text()
    assert written == render(build_parser()), (
        "docs/reference.md is stale: python -m tracetap.reference > docs/reference.md")


@pytest.mark.parametrize("given", ["flag", "variable", "file flag", "file variable", "none"])
def test_the_start_up_line_names_where_the_admin_token_came_from(given, engine, run_proxy,
                                                                  tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("t" * 40 + "\n")
    extra, env = {
        "flag": (("--admin-token", "f" * 40), {}),
        "variable": ((), {"TRACETAP_ADMIN_TOKEN": "v" * 40}),
        "file flag": (("--admin-token-file", str(token_file)), {}),
        "file variable": ((), {"TRACETAP_ADMIN_TOKEN_FILE": str(token_file)}),
        "none": ((), {}),
    }[given]
    proxy = run_proxy(engine.url, f"sqlite:///{tmp_path / 't.db'}", *extra,
                      env={"TRACETAP_ADMIN_TOKEN": "", "TRACETAP_ADMIN_TOKEN_FILE": "", **env})
    (line,) = [x for x in proxy.log.read_text().splitlines() if "listening on" in x]
    assert line.endswith({
        "flag": "admin token from --admin-token",
        "variable": "admin token from TRACETAP_ADMIN_TOKEN",
        "file flag": f"admin token from the file {token_file} (--admin-token-file)",
        "file variable": f"admin token from the file {token_file} (TRACETAP_ADMIN_TOKEN_FILE)",
        "none": f"admin token in {tmp_path / 'data' / 'admin-token'}",
    }[given]), line
