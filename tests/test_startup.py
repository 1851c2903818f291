"""What `tracetap serve` says at start about the common mistakes, in one line."""

from __future__ import annotations

import socket
import subprocess
import sys

from conftest import free_port


def _serve(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", "serve", "--data-dir", str(tmp_path / "d"),
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
            [sys.executable, "-m", "proxy.cli", "serve", "--upstream", engine.url,
             "--data-dir", str(tmp_path / "d"), "--port", str(port)],
            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "listening on" not in result.stdout
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
