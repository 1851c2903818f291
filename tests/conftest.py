"""Shared fixtures: a real Postgres (or SQLite), the mock engine, the running proxy.

Servers run on an event loop in a background thread so tests can drive them with the
real (sync or async) ``openai`` SDK. Storage tests run against the real Postgres on
127.0.0.1:5432; they skip only when it is unreachable and CI is not set.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import asyncpg
import msgspec
import pytest
from aiohttp import web
from hypothesis import HealthCheck, settings

from tracetap.demo.engine import EngineConfig, EngineServer
from tracetap.migrations import upgrade
from tracetap.proxy import connections, serve
from tracetap.proxy.admin_token import read_admin_token
from tracetap.proxy.app import build_app
from tracetap.proxy.keys import STATE
from tracetap.proxy.settings import Settings
from tracetap.proxy.sse import SSEParser
from tracetap.storage import queries
from tracetap.storage.engine import create_engine

PG_ADMIN = os.environ.get("TRACETAP_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")

# The suite runs on a shared 2-core machine where other jobs can stall this process for
# a second or more: Hypothesis' default 200 ms deadline would measure that load, and a
# slow first run that is fast on replay fails as "unreliable timings". The deadline stays,
# but at 5 s: an example that slow is pathological, not unlucky. HYPOTHESIS_PROFILE=default
# restores Hypothesis' own settings.
settings.register_profile("shared-2-core", deadline=5000,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "shared-2-core"))


class LoopThread:
    """An event loop running in a daemon thread; ``run`` executes a coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


# Base URLs registration handed out, by (agent URL, episode id): a registered episode
# takes calls only with its key, which its base URL carries.
BASE_URLS: dict[tuple[str, str], str] = {}


@pytest.fixture(autouse=True)
def _forget_base_urls():
    yield
    BASE_URLS.clear()  # ports are reused by later tests


def episode_url(agent_url: str, episode_id: str) -> str:
    """The base URL an agent of this episode uses: the registered one, else the plain
    path-tagged one."""
    return BASE_URLS.get((agent_url, episode_id), f"{agent_url}/episodes/{episode_id}/v1")


def episode_headers(agent_url: str, episode_id: str) -> dict[str, str]:
    """Headers that tag a call with an episode: its id, and its key when registered."""
    headers = {"X-Tracetap-Episode": episode_id}
    base_url = BASE_URLS.get((agent_url, episode_id))
    if base_url is not None:
        secret = base_url.rsplit("/", 2)[-2].partition("~")[2]
        headers["Authorization"] = f"Bearer tt-{secret}"
    return headers


def admin_call(url: str, method: str, path: str, body=None,
               token: str | None = None) -> tuple[int, dict]:
    """One admin API request; returns (status, decoded JSON body) without raising."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            status, created = reply.status, json.loads(reply.read())
        if method == "POST" and path == "/tracetap/episodes" and status == 201:
            prefix, _, _ = created["base_url"].partition("/episodes/")
            BASE_URLS[(prefix, created["id"])] = created["base_url"]
        return status, created
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.loads(err.read())


def _postgres_available() -> bool:
    async def probe():
        conn = await asyncpg.connect(_asyncpg_dsn(PG_ADMIN), timeout=3)
        await conn.close()

    try:
        asyncio.run(probe())
        return True
    except (OSError, asyncpg.PostgresError, asyncio.TimeoutError):
        return False


def _asyncpg_dsn(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://")


def create_postgres_database() -> str:
    """A new, empty database on the test server; returns its URL."""
    name = f"tracetap_test_{uuid.uuid4().hex[:12]}"

    async def create():
        conn = await asyncpg.connect(_asyncpg_dsn(PG_ADMIN))
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    asyncio.run(create())
    return PG_ADMIN.rsplit("/", 1)[0] + "/" + name


def drop_postgres_database(url: str) -> None:
    name = url.rsplit("/", 1)[1]

    async def drop():
        conn = await asyncpg.connect(_asyncpg_dsn(PG_ADMIN))
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    asyncio.run(drop())


@pytest.fixture(scope="session")
def postgres_ok() -> bool:
    ok = _postgres_available()
    if not ok and os.environ.get("CI"):
        pytest.fail(f"Postgres is required in CI and is not reachable at {PG_ADMIN}")
    return ok


@pytest.fixture
def postgres(postgres_ok) -> None:
    """Skips the test when no Postgres is reachable (postgres_ok fails it in CI)."""
    if not postgres_ok:
        pytest.skip("no Postgres reachable (allowed only outside CI)")


@pytest.fixture
def fresh_postgres(postgres) -> Iterator[str]:
    url = create_postgres_database()
    try:
        yield url
    finally:
        drop_postgres_database(url)


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path: Path) -> Iterator[str]:
    """An empty, migrated database of each kind."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'tracetap.db'}"
        upgrade(url)
        yield url
    else:
        url = request.getfixturevalue("fresh_postgres")
        upgrade(url)
        yield url


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


def translating_app(api, upstream: str, *, model_map=None, sent: list | None = None):
    """A minimal translating server around one ``proxy.apis.*.translate`` module: the
    client's API in, chat completions to ``upstream``, the client's API back (tests only;
    the proxy wires translation itself). Chat requests sent upstream go to ``sent``."""
    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        try:
            chat = api.to_chat(body, model_map=model_map)
        except api.Untranslatable as exc:
            return web.Response(status=400, body=api.ERRORS.body(api.untranslatable(exc)),
                                content_type="application/json")
        if sent is not None:
            sent.append(chat)
        async with aiohttp.ClientSession() as session, session.post(
                upstream + "/v1/chat/completions", json=chat) as up:
            if up.status != 200:
                return web.Response(status=up.status, content_type="application/json",
                                    body=api.error_from_chat(up.status, await up.read()))
            if not chat.get("stream"):
                return web.json_response(api.from_chat(await up.json(), body))
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            translator, parser, done = api.StreamTranslator(body), SSEParser(), False
            async for data in up.content.iter_any():
                for event in parser.feed(data):
                    if event.data == b"[DONE]":
                        events, done = translator.finish(), True
                    elif event.data is not None:
                        events = translator.feed(msgspec.json.decode(event.data))
                    else:
                        events = []
                    for encoded in events:
                        await out.write(encoded)
            if not done:
                await out.write(translator.error_event("upstream stream ended early"))
            await out.write_eof()
            return out

    app = web.Application()
    app.router.add_post("/v1/responses", handle)
    app.router.add_post("/v1/messages", handle)
    return app


def scripted_chat_app(reply) -> web.Application:
    """A chat-completions upstream that answers every request with ``reply``: a list of
    stream chunks (sent as SSE, then [DONE]), a whole body (dict), or (status, bytes)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        if isinstance(reply, tuple):
            return web.Response(status=reply[0], body=reply[1])
        if isinstance(reply, dict):
            return web.json_response(reply)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for chunk in reply:
            await out.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    return app


CHAT_USAGE = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18,
              "prompt_tokens_details": {"cached_tokens": 4},
              "completion_tokens_details": {"reasoning_tokens": 3}}


def chat_reply(text=None, reasoning=None, calls=(), finish="stop", usage=None, **choice):
    message = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            for cid, name, args in calls]
    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000,
            "model": "m", "choices": [{"index": 0, "message": message,
                                       "finish_reason": finish, **choice}]}
    if usage is not None:
        body["usage"] = usage
    return body


def stream_chunks(text=None, reasoning=None, calls=(), finish="stop", usage=None,
                  pieces=3) -> list[dict]:
    """The chunks a chat server streams for ``chat_reply(...)``, split into ``pieces``."""

    def split(s: str) -> list[str]:
        size = max(1, -(-len(s) // pieces))
        return [s[i:i + size] for i in range(0, len(s), size)] or [""]

    def chunk(delta=None, finish_reason=None, **extra):
        choice = {"index": 0, "delta": delta or {}, "finish_reason": finish_reason}
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000,
                "model": "m", "choices": [choice], **extra}

    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"reasoning_content": p}) for p in split(reasoning)] if reasoning else []
    out += [chunk({"content": p}) for p in split(text)] if text else []
    for index, (cid, name, args) in enumerate(calls):
        out.append(chunk({"tool_calls": [{"index": index, "id": cid, "type": "function",
                                          "function": {"name": name, "arguments": ""}}]}))
        out += [chunk({"tool_calls": [{"index": index, "function": {"arguments": p}}]})
                for p in split(args) if p]
    out.append(chunk(finish_reason=finish))
    if usage is not None:
        out.append({**chunk(), "choices": [], "usage": usage})
    return out
