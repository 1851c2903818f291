"""``tracetap demo``: the whole loop in one process, no GPU: engine, proxy, agent, Parquet.

On free local ports, in one event loop: the deterministic mock engine, the real tracetap
proxy in front of it (embedded SQLite in the data dir), and the scripted ``openai`` SDK
agent. Episodes are registered and finished through the admin API, the proxy is stopped
(its writer flushes), and the exporter writes ``<data-dir>/export``. With ``--ui`` the
proxy (and its trace viewer) stays up after the export until Ctrl-C.

Importing this module is cheap (the CLI builds every subcommand's parser): the servers,
the SDK and pyarrow load only inside ``run``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tracetap.demo import report

if TYPE_CHECKING:
    import aiohttp

MODEL = "mock-model"
CAPTURE_TIMEOUT_S = 10.0
_CREATED = ("tracetap.db", "tracetap.db-wal", "tracetap.db-shm", "journal", "export")


class DemoError(Exception):
    """The demo could not complete; the message says what went wrong."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--data-dir", metavar="DIR",
      help="where the SQLite database, journal and export go (kept); default: a temp dir")
    a("--keep", action="store_true",
      help="keep the data dir for inspection (the default unless --clean)")
    a("--clean", action="store_true",
      help="remove what the demo wrote to the data dir at the end [default off]")
    a("--episodes", type=int, default=3, metavar="N",
      help="append-only multi-turn episodes to run; the context-rewrite episode, the group "
           "of 4 and one Responses-API and one Messages-API episode always run [default 3]")
    a("--quiet", action="store_true", help="print only the final table [default off]")
    a("--ui", action="store_true",
      help="keep the proxy and its trace viewer up after the demo (Ctrl-C stops them) and "
           "print where to look [default off]")
    a("--port", type=int, default=0, metavar="N",
      help="the proxy's port (and so the viewer's); default: a free one")
    a("--variants", action="store_true",
      help="also run every task twice under two harness variants (factor context: the agent "
           "keeps its full history, or summarises it before turn 2), for tracetap packets, "
           "compare and harnesses [default off]")
    a("--engineer", action="store_true",
      help="instead, run tracetap engineer's loop (Harness-R1) on the mock engine: a "
           "scripted engineer's useful, useless and broken patches, each rewarded with its "
           "Δ_B or the penalty (docs/harness-engineering.md) [default off]")


@dataclass(frozen=True)
class Plan:
    id: str
    # "append-only", "context-rewrite", "group", "responses-api", "messages-api",
    # "harness-full", "harness-summarised" (--variants)
    variant: str
    task: Any  # agent.Task
    tool_rounds: int
    seed: int = 0
    rewrite_at: int | None = None
    group_id: str | None = None
    api: str = "chat"  # or "responses", "messages": the wire API the agent speaks
    context: str | None = None  # the harness factor of --variants: "full" or "summarised"


def plan_episodes(run_id: str, append_only: int, variants: bool = False) -> list[list[Plan]]:
    """Phases of episodes; the episodes of a phase run concurrently (a GRPO group)."""
    from tracetap.demo.agent import TASKS

    prefix = f"demo-{run_id}"
    solo = [[Plan(f"{prefix}-solo-{k}", "append-only", TASKS[(k - 1) % 3], 2 + (k - 1) % 3)]
            for k in range(1, append_only + 1)]
    rewrite = [Plan(f"{prefix}-rewrite", "context-rewrite", TASKS[3], 2, rewrite_at=3)]
    group = [Plan(f"{prefix}-group-{k}", "group", TASKS[1], 2, seed=k, group_id=f"{prefix}-g")
             for k in range(1, 5)]
    apis = [Plan(f"{prefix}-responses", "responses-api", TASKS[0], 2, api="responses"),
            Plan(f"{prefix}-messages", "messages-api", TASKS[2], 2, api="messages")]
    phases = [*solo, rewrite, group, apis]
    if variants:  # one task batch under two harness variants, two seeds each
        phases.append([
            Plan(f"{prefix}-{context}-{task.id}-{seed}", f"harness-{context}", task, 2,
                 seed=seed, rewrite_at=2 if context == "summarised" else None,
                 context=context)
            for context in ("full", "summarised") for task in TASKS for seed in (1, 2)])
    return phases


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if args.engineer:
        from tracetap.demo import engineer_demo

        return engineer_demo.run(args)
    if args.episodes < 0:
        print("tracetap demo: error: --episodes must be 0 or more", file=sys.stderr)
        return 2
    try:  # the agents are written with the official SDKs
        import anthropic  # noqa: F401
        import openai  # noqa: F401
    except ImportError as exc:
        print(f"tracetap demo: error: the demo's agents need the {exc.name} SDK: "
              "pip install 'tracetap[demo]'", file=sys.stderr)
        return 1
    root = logging.getLogger()
    if root.level == logging.INFO:  # the default: the demo prints its own story instead
        root.setLevel(logging.WARNING)
    given = args.data_dir is not None
    data_dir = Path(args.data_dir) if given else Path(tempfile.mkdtemp(prefix="tracetap-demo-"))
    existed = {name for name in _CREATED if (data_dir / name).exists()}
    dir_existed = given and data_dir.exists()
    keep = args.keep or not args.clean
    say = (lambda *_: None) if args.quiet else _say
    try:
        _run_loop(_demo(data_dir.resolve(), args.episodes, say, keep, started, args.ui,
                        args.port, args.variants))
    except KeyboardInterrupt:
        if args.ui:  # the way out of --ui: the proxy and the engine stopped in order
            print("tracetap demo: stopped", flush=True)
            return 0
        print("tracetap demo: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # any failure: one clear line, then a non-zero exit
        print(f"tracetap demo: error: {_describe(exc)}", file=sys.stderr)
        if keep and data_dir.is_dir():
            print(f"tracetap demo: what it wrote is in {data_dir}", file=sys.stderr)
        return 1
    finally:
        if not keep:
            _remove(data_dir, existed, dir_existed)
    return 0


async def _demo(data_dir: Path, append_only: int, say, keep: bool, started: float,
                ui: bool = False, port: int = 0, variants: bool = False) -> None:
    import aiohttp
    from aiohttp import web

    from tracetap.demo.engine import EngineConfig, EngineServer
    from tracetap.exporters import ExportError, export_async
    from tracetap.migrations import upgrade_async
    from tracetap.proxy.runtime.keys import STATE
    from tracetap.proxy.runtime.settings import Settings
    from tracetap.proxy.server.app import build_app

    run_id = uuid.uuid4().hex[:6]
    phases = plan_episodes(run_id, append_only, variants)
    say(f"tracetap demo: data dir {data_dir}")
    async with contextlib.AsyncExitStack() as stack:
        engine = await stack.enter_async_context(EngineServer(EngineConfig(model=MODEL)))
        say(f"  engine  deterministic vLLM-like mock engine at {engine.url}")
        sock = socket.socket()
        stack.callback(sock.close)  # the server closes it too; closing twice is harmless
        sock.bind(("127.0.0.1", port))
        # The demo plays the operator: its token lives in memory, not in the data dir.
        settings = Settings(upstream=[engine.url], data_dir=str(data_dir),
                            port=sock.getsockname()[1], upstream_flavor="auto",
                            admin_token=secrets.token_urlsafe(32))
        await upgrade_async(settings.database_url)
        proxy = web.AppRunner(build_app(settings), access_log=None)
        await proxy.setup()
        proxy_up = True

        async def stop_proxy() -> None:
            nonlocal proxy_up
            if proxy_up:
                proxy_up = False
                await proxy.cleanup()  # drains the writer: every record is committed

        stack.push_async_callback(stop_proxy)
        await web.SockSite(proxy, sock).start()
        say(f"  proxy   tracetap at {settings.base_url} -> {engine.url}, "
            f"storing in {settings.database_url}")
        say("  agent   scripted tool-using agent on the openai SDK (AsyncOpenAI)")
        session = await stack.enter_async_context(aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {settings.admin_token}"}))
        admin = Admin(session, settings.base_url)
        totals = {"episodes": 0, "calls": 0, "generated": 0}
        for phase in phases:
            say("")
            results = await asyncio.gather(*(_episode(admin, p, say) for p in phase),
                                           return_exceptions=True)  # let the others finish
            for calls in results:
                if isinstance(calls, BaseException):
                    raise calls
                totals["episodes"] += 1
                totals["calls"] += len(calls)
                totals["generated"] += sum(c["completion_tokens"] or 0 for c in calls)
        written = await admin.records_written()
        if ui:
            await proxy.app[STATE].writer.flush()  # every record committed; the proxy stays up
            say(f"\n/metrics counted {written} records written to the database")
        else:
            await stop_proxy()
            say(f"\nproxy stopped; /metrics counted {written} records written to the database")
        out = data_dir / "export"
        ids = [p.id for phase in phases for p in phase]
        try:
            summary = await export_async(settings.database_url, out, episodes=ids,
                                         overwrite=True)
        except ExportError as exc:
            raise DemoError(f"export failed: {exc}") from exc
        if summary.episodes != totals["episodes"] or summary.calls != totals["calls"]:
            raise DemoError(f"the export holds {summary.episodes} episodes and {summary.calls} "
                            f"calls; the demo ran {totals['episodes']} and {totals['calls']}")
        report.table(summary, totals, out, keep, time.perf_counter() - started)
        if variants:
            report.loop_hint(data_dir)
        if ui:
            await _keep_viewing(settings, phases)


async def _keep_viewing(settings, phases: list[list[Plan]]) -> None:
    """Print where to look in the viewer, then serve until Ctrl-C (or SIGTERM)."""
    from tracetap.viewer import PREFIX

    ui = f"{settings.base_url}{PREFIX}"
    rewrite = next(p.id for phase in phases for p in phase if p.variant == "context-rewrite")
    print(f"\ntrace viewer: {ui}/")
    print(f"  log in with the admin token: {settings.admin_token}")
    print(f"  failed episodes:        {ui}/?outcome=failed")
    print(f"  the GRPO group:         {ui}/groups")
    print(f"  why the rewrite split:  {ui}/episodes/{rewrite}?t=1#tokens")
    print(f"  live calls:             {ui}/live  (agents: {settings.base_url}/episodes/<id>/v1)")
    print("the proxy and the viewer stay up; Ctrl-C stops them", flush=True)
    # Ctrl-C cancels this task (the runner's SIGINT handling); SIGTERM ends it here.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await stop.wait()
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


async def _episode(admin: Admin, plan: Plan, say) -> list[dict]:
    from openai import AsyncOpenAI

    from tracetap.demo.agent import run_agent
    from tracetap.demo.api_agents import run_messages_agent, run_responses_agent

    config = {"variant": plan.variant, "seed": plan.seed, "tool_rounds": plan.tool_rounds,
              "rewrite_at": plan.rewrite_at}
    if plan.context is not None:  # a harness factor: docs/harness-engineering.md
        config["context"] = plan.context
    harness = {"name": "tracetap-demo-agent" + (f"-{plan.context}" if plan.context else ""),
               "config": config}
    created = await admin.post("/tracetap/episodes", {
        "id": plan.id, "group_id": plan.group_id, "task_id": plan.task.id,
        "harness": harness,
        "metadata": {"demo": True, **({"batch": "variants"} if plan.context else {})}})
    group = f", group {plan.group_id} seed {plan.seed}" if plan.group_id else ""
    say(f"> {plan.id:<22} started   {plan.variant}, task {plan.task.id}{group}"
        f"{'' if plan.api == 'chat' else f', {plan.api} API'}")
    extra_body = {"mock_tool_rounds": plan.tool_rounds}
    if plan.api == "messages":
        from anthropic import AsyncAnthropic

        # The Anthropic SDK adds /v1 itself; the minted key goes out as x-api-key.
        client = AsyncAnthropic(base_url=created["base_url"].removesuffix("/v1"),
                                api_key=created["api_key"], max_retries=0, timeout=30)
        async with client:
            result = await run_messages_agent(client, plan.task, model=MODEL)
    else:
        client = AsyncOpenAI(base_url=created["base_url"], api_key=created["api_key"],
                             max_retries=0, timeout=30)
        async with client:
            if plan.api == "responses":
                result = await run_responses_agent(client, plan.task, model=MODEL,
                                                   extra_body=extra_body)
            else:
                result = await run_agent(client, plan.task, model=MODEL, seed=plan.seed,
                                         rewrite_at=plan.rewrite_at, extra_body=extra_body)
    reward = result.reward()
    await admin.post(f"/tracetap/episodes/{plan.id}/finish", {
        "reward": reward, "rewards": {"keywords": reward}, "outcome": result.outcome(),
        "info": {"turns": len(result.turns), "lookups": result.lookups,
                 "answer": result.answer}})
    calls = await admin.captured(plan.id, len(result.turns))
    streamed = sum(t.streamed for t in result.turns)
    rewrite = f", context rewritten at turn {result.rewritten_at}" if result.rewritten_at else ""
    say(f"< {plan.id:<22} finished  {len(result.turns)} turns ({streamed} streamed), "
        f"{result.lookups} lookups{rewrite}, reward {reward:.1f} ({result.outcome()}); "
        f"{len(calls)} calls captured")
    say(f"  {'':<22} answer: {result.answer!r}")
    return calls


class Admin:
    """The proxy's admin API, as an orchestrator (a trainer's rollout loop) would use it."""

    def __init__(self, session: aiohttp.ClientSession, url: str):
        self.session, self.url = session, url

    async def post(self, path: str, body: dict) -> dict:
        async with self.session.post(self.url + path, json=body) as reply:
            if reply.status >= 300:
                raise DemoError(f"POST {path} answered {reply.status}: {await reply.text()}")
            return await reply.json()

    async def captured(self, episode_id: str, expected: int) -> list[dict]:
        """The episode's stored calls, once the write-behind writer has committed them all."""
        deadline = time.monotonic() + CAPTURE_TIMEOUT_S
        while True:
            async with self.session.get(f"{self.url}/tracetap/episodes/{episode_id}") as reply:
                if reply.status != 200:
                    raise DemoError(f"GET episode {episode_id} answered {reply.status}")
                calls = (await reply.json())["calls"]
            if len(calls) >= expected:
                return calls
            if time.monotonic() > deadline:
                raise DemoError(f"only {len(calls)} of {expected} calls of {episode_id} reached "
                                f"the database within {CAPTURE_TIMEOUT_S:.0f}s")
            await asyncio.sleep(0.02)  # the writer commits every 50 ms

    async def records_written(self) -> int:
        async with self.session.get(self.url + "/metrics") as reply:
            text = await reply.text()
        for line in text.splitlines():
            if line.startswith('tracetap_records_total{outcome="written"}'):
                return int(float(line.split()[-1]))
        return 0


def _say(line: str) -> None:
    print(line, flush=True)


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if isinstance(exc, (DemoError, OSError)) else f"{type(exc).__name__}: {text}"


def _remove(data_dir: Path, existed: set[str], dir_existed: bool) -> None:
    """Remove what the demo created; never a file or directory that was there before."""
    if not dir_existed:
        shutil.rmtree(data_dir, ignore_errors=True)
        return
    for name in set(_CREATED) - existed:
        path = data_dir / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _run_loop(coro) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        asyncio.run(coro)
        return
    uvloop.run(coro)
