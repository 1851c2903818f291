"""Servers the tests run (a pytest plugin, loaded by tests/conftest.py): the proxy
in-process on a background loop (``Proxy``, fixture ``proxy``) or as ``tracetap serve``
(``ProxyProcess``, fixture ``run_proxy``), the mock engine (``engine``), small aiohttp
upstreams (``serve_app``), a TCP forwarder to Postgres that a test can cut
(``Forwarder``), and the calls as stored (``stored_calls``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from helpers.http import BASE_URLS, admin_call, episode_url
from helpers.loop import LoopThread, free_port
from tracetap.demo.engine import EngineConfig, EngineServer
from tracetap.proxy.admin.token import read_admin_token
from tracetap.proxy.runtime.keys import STATE
from tracetap.proxy.runtime.settings import Settings
from tracetap.proxy.server import connections, serve
from tracetap.proxy.server.app import build_app
from tracetap.storage import queries
from tracetap.storage.engine import create_engine


class Proxy:
    """A running tracetap app (and its engine) on a background loop."""

    def __init__(self, loop: LoopThread, settings: Settings):
        self.loop = loop
        self.settings = settings
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    def episode_url(self, episode_id: str) -> str:
        return episode_url(self.url, episode_id)

    @property
    def state(self):
        return self.runner.app[STATE]

    @property
    def admin_token(self) -> str:
        return self.state.admin_token

    def admin(self, method: str, path: str, body=None, token: str | None = None):
        return admin_call(self.url, method, path, body, token or self.admin_token)

    def start(self) -> Proxy:
        async def _start():
            # As `tracetap serve` runs it: the same timeouts and connection caps.
            self.runner = connections.runner(build_app(self.settings), self.settings)
            await self.runner.setup()
            serve.serve_connections(self.runner, self.settings)
            await web.TCPSite(self.runner, "127.0.0.1", self.settings.port).start()

        self.loop.run(_start())
        return self

    def stop(self) -> None:
        if self.runner is not None:
            self.loop.run(self.runner.cleanup())
            self.runner = None

    def flush(self) -> None:
        """Commit everything captured so far (the writer's own flush, not a sleep)."""
        self.loop.run(self.state.writer.flush())

    def calls(self, episode_id: str | None) -> list[dict]:
        self.flush()
        return self.loop.run(queries.calls_of(self.state.engine, episode_id))

    def episode(self, episode_id: str) -> dict | None:
        return self.loop.run(queries.get_episode(self.state.engine, episode_id))




@pytest.fixture(autouse=True)
def _forget_base_urls():
    yield
    BASE_URLS.clear()  # ports are reused by later tests


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture
def engine_config() -> EngineConfig:
    return EngineConfig(flavor="vllm")


@pytest.fixture
def engine(loop_thread, engine_config) -> Iterator[EngineServer]:
    server = EngineServer(engine_config)
    loop_thread.run(server.start())
    yield server
    loop_thread.run(server.close())


@pytest.fixture
def proxy_settings(engine, db_url, tmp_path) -> Settings:
    return Settings(upstream=engine.url, db=db_url, data_dir=str(tmp_path / "data"),
                    port=free_port(), upstream_flavor="auto")


@pytest.fixture
def proxy(loop_thread, proxy_settings) -> Iterator[Proxy]:
    p = Proxy(loop_thread, proxy_settings).start()
    yield p
    p.stop()


class ProxyProcess:
    """``tracetap serve`` as a real subprocess, for signals, restarts and RSS."""

    def __init__(self, *, upstream: str, db: str, data_dir: Path, log: Path,
                 extra: tuple[str, ...] = (), env: dict | None = None):
        self.port = free_port()
        self.args = [sys.executable, "-m", "tracetap", "serve", "--upstream", upstream,
                     "--db", db, "--data-dir", str(data_dir), "--port", str(self.port), *extra]
        self.log = log
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def episode_url(self, episode_id: str) -> str:
        return episode_url(self.url, episode_id)

    def start(self, timeout: float = 60.0) -> ProxyProcess:
        with open(self.log, "ab") as log:
            offset = log.tell()
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"proxy exited early:\n{self.log.read_text()}")
            # Announced once every process serves (serve --workers N: all N).
            announced = b"listening on" in self.log.read_bytes()[offset:]
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1):
                    if announced:
                        return self
            except OSError:
                pass
            time.sleep(0.05)  # polling for readiness, not waiting for a result
        raise RuntimeError(f"proxy did not start:\n{self.log.read_text()}")

    def signal(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    @property
    def admin_token(self) -> str:
        for i, arg in enumerate(self.args):
            if arg == "--admin-token":
                return self.args[i + 1]
        data_dir = self.args[self.args.index("--data-dir") + 1]
        token = read_admin_token(data_dir)
        assert token is not None, "serve writes the admin token before it listens"
        return token

    def admin(self, method: str, path: str, body=None, token: str | None = None):
        return admin_call(self.url, method, path, body, token or self.admin_token)

    def rss_bytes(self) -> int:
        assert self.process is not None
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Forwarder:
    """A TCP forwarder to Postgres that the test can cut and restore."""

    def __init__(self, loop, port: int, target: int = 5432):
        self.loop, self.port, self.target = loop, port, target
        self.server = None
        self.writers: set[asyncio.StreamWriter] = set()

    def route(self, url: str) -> str:
        """``url`` (a database on the target port) reached through the forwarder."""
        return url.replace(f":{self.target}/", f":{self.port}/")

    async def _pipe(self, reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _handle(self, reader, writer):
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()
            return
        self.writers |= {writer, up_writer}
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.transport.abort()
                self.writers.discard(w)

    def start(self) -> None:
        async def start():
            self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.loop.run(start())

    def cut(self) -> None:
        async def cut():
            self.server.close()
            for writer in list(self.writers):
                writer.transport.abort()
            await self.server.wait_closed()
        self.loop.run(cut())


def stored_calls(db: str, episode_id: str | None) -> list[dict]:
    """Calls as stored, read with a fresh engine (the proxy may be another process)."""

    async def read():
        engine = create_engine(db)
        try:
            return await queries.calls_of(engine, episode_id)
        finally:
            await engine.dispose()

    return asyncio.run(read())


@pytest.fixture
def run_proxy(tmp_path) -> Iterator:
    """Factory for subprocess proxies; all are stopped at the end of the test."""
    started: list[ProxyProcess] = []

    def factory(upstream: str, db: str, *extra: str, data_dir: Path | None = None,
                env: dict | None = None) -> ProxyProcess:
        proc = ProxyProcess(upstream=upstream, db=db, data_dir=data_dir or tmp_path / "data",
                            log=tmp_path / f"proxy-{len(started)}.log", extra=extra, env=env)
        started.append(proc)
        return proc.start()

    yield factory
    for proc in started:
        proc.stop()


@pytest.fixture
def serve_app(loop_thread) -> Iterator:
    """Factory: run a small aiohttp app (a custom upstream) and return its base URL."""
    runners: list[web.AppRunner] = []

    def start(app: web.Application) -> str:
        runner = web.AppRunner(app, access_log=None)
        port = free_port()

        async def go():
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()

        loop_thread.run(go())
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        loop_thread.run(runner.cleanup())

