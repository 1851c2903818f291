"""The shipped HAProxy config (deploy/haproxy/haproxy.cfg) run in front of local replicas.

Used by tests/test_haproxy.py and bench/replicas_bench.py: the routing, health checks and
timeouts are the shipped file's; only the ``server`` lines (the compose service names) are
replaced by the local replicas' addresses, and the listen address and stats socket come
from the environment variables the file reads.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "haproxy" / "haproxy.cfg"
BACKEND = "tracetap"  # model calls
ADMIN_BACKEND = "tracetap_admin"  # /tracetap/* and /metrics, its own health check
BACKENDS = (BACKEND, ADMIN_BACKEND)
SERVER_LINE = re.compile(r"^\s*server\s.*\n", re.M)
SECTION = re.compile(r"^(?=\S)", re.M)  # a section starts at an unindented line


def render(servers: dict[str, str], config: str | None = None) -> str:
    """The shipped config with ``servers`` (name -> host:port) as each backend's servers."""
    text = CONFIG.read_text() if config is None else config
    lines = "".join(f"    server {name} {addr}\n" for name, addr in servers.items())
    sections = SECTION.split(SERVER_LINE.sub("", text))
    found = set()
    for i, section in enumerate(sections):
        name = section.split("\n", 1)[0].split()
        if name[:1] == ["backend"] and name[1] in BACKENDS:
            found.add(name[1])
            # Servers go last in the backend section.
            sections[i] = section.rstrip("\n") + "\n" + lines + "\n"
    assert found == set(BACKENDS), f"the config lost a backend: has {found}"
    return "".join(sections)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HAProxy:
    """haproxy as a subprocess, with its stats socket for runtime changes."""

    def __init__(self, workdir: Path, servers: dict[str, str]):
        self.binary = shutil.which("haproxy") or "/usr/sbin/haproxy"
        self.port = free_port()
        self.socket = workdir / "haproxy.sock"
        self.config = workdir / "haproxy.cfg"
        self.config.write_text(render(servers))
        # The errorfiles, where the config (default-path config) looks for them.
        shutil.copytree(CONFIG.parent / "errors", workdir / "errors", dirs_exist_ok=True)
        self.log = workdir / "haproxy.log"
        self.env = {**os.environ, "HAPROXY_BIND": f"127.0.0.1:{self.port}",
                    "HAPROXY_STATS_SOCKET": str(self.socket)}
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> HAProxy:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen([self.binary, "-db", "-f", str(self.config)],
                                            stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"haproxy exited:\n{self.log.read_text()}")
            if self.socket.exists() and self.up():
                return self
            time.sleep(0.05)  # polling for the first good health checks
        raise RuntimeError(f"haproxy found no healthy replica:\n{self.log.read_text()}")

    def command(self, line: str) -> str:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.socket))
            s.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def states(self, backend: str = BACKEND) -> dict[str, str]:
        """Server name -> HAProxy's status (UP, DOWN, MAINT, ...) in ``backend``."""
        rows = self.command("show stat").splitlines()
        header = rows[0].lstrip("# ").split(",")
        found = {}
        for row in rows[1:]:
            fields = dict(zip(header, row.split(","), strict=False))
            if fields.get("pxname") == backend and fields.get("svname") not in (
                    "BACKEND", "FRONTEND", None):
                found[fields["svname"]] = fields["status"]
        return found

    def up(self, backend: str = BACKEND) -> list[str]:
        return sorted(name for name, status in self.states(backend).items()
                      if status.startswith("UP"))

    def add_server(self, name: str, addr: str) -> None:
        """A new replica joins both backends at runtime (no reload), health-checked like the
        rest (each backend's own check)."""
        for backend in BACKENDS:
            for line in (f"add server {backend}/{name} {addr} check inter 1s fall 1 rise 2",
                         f"enable health {backend}/{name}", f"enable server {backend}/{name}"):
                answer = self.command(line)
                assert "rror" not in answer and "nknown" not in answer, (line, answer)

    def wait_until(self, condition, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"HAProxy states: {self.states()}")
            time.sleep(0.1)  # polling HAProxy's health-check results

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
