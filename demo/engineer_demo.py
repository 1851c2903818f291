"""``tracetap demo --engineer``: the Harness-R1 loop on the mock engine, in under a minute.

The mock engine gives invalid tool arguments on a seeded 40% of tool calls, which the
scripted agent fails on. A scripted engineer (the mock engine answering given text,
``mock_content``, through tracetap like any engineer model) proposes three patches: a
tool-argument validator (useful), a patch that does nothing (useless) and one whose
hook breaks on the recorded calls (broken). ``tracetap engineer``'s loop validates each,
runs the batch with the valid ones and writes Δ_B as each engineer episode's reward.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import sys
import tempfile
import time
from pathlib import Path

USEFUL = '''```python
import json

AFTER_MODEL_SEES = "tool_calls"


def problem(call, tools):
    """Why a tool call does not fit its tool's schema (None when it does)."""
    for tool in tools or ():
        function = tool.get("function") or {}
        if function.get("name") == call.name:
            schema = function.get("parameters") or {}
            break
    else:
        return f"there is no tool {call.name!r}"
    try:
        arguments = json.loads(call.arguments or "{}")
    except ValueError:
        return "the arguments are not JSON"
    if not isinstance(arguments, dict):
        return "the arguments are not a JSON object"
    for name in schema.get("required", ()):
        if name not in arguments:
            return f"{name!r} is required"
    for name, value in arguments.items():
        kind = (schema.get("properties") or {}).get(name, {}).get("type")
        if kind == "integer" and (type(value) is not int):
            return f"{name!r} must be an integer"
    return None


async def after_model(reply, state):
    for call in reply.tool_calls:
        why = problem(call, reply.tools)
        if why:
            return Veto(feedback=f"Call {call.name} again: {why}.", reason=why)
```'''
USELESS = """The agent should just be more careful.
```python
async def before_model(request, state):
    return None
```"""
BROKEN = """```python
async def after_model(reply, state):
    step = reply.tool_calls[0].arguments["step"]  # arguments are JSON text, not a dict
    return None
```"""
CANDIDATES = (USEFUL, USELESS, BROKEN)
MODEL = "mock-model"


def run(args) -> int:
    import asyncio

    started = time.perf_counter()
    try:
        rows = asyncio.run(_demo(Path(args.data_dir) if args.data_dir else None))
    except Exception as exc:  # one clear line, then a non-zero exit
        print(f"tracetap demo --engineer: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    useful = next(r for r in rows if r.candidate == 0)
    shown = "invalid" if useful.delta is None else f"{useful.delta:+.2f}"
    print(
        f"\nthe useful patch's Δ_B: {shown}; the whole loop took "
        f"{time.perf_counter() - started:.1f} s"
    )
    return 0 if useful.valid and (useful.delta or 0) > 0 else 1


async def _demo(data_dir: Path | None):
    from aiohttp import web

    from tracetap.analysis.engineer.loop import Options, engineer
    from tracetap.analysis.engineer.table import render
    from tracetap.analysis.runner import plan
    from tracetap.analysis.runner.admin import AdminClient
    from tracetap.analysis.runner.episode import Commands
    from tracetap.demo.agent import TASKS
    from tracetap.demo.engine import EngineConfig, EngineServer
    from tracetap.exporters import export_async
    from tracetap.migrations import upgrade_async
    from tracetap.proxy.apis.registry import readers
    from tracetap.proxy.runtime.settings import Settings
    from tracetap.proxy.server.app import build_app

    data_dir = data_dir or Path(tempfile.mkdtemp(prefix="tracetap-engineer-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    print(f"tracetap demo --engineer: data dir {data_dir}")
    tasks_file = data_dir / "tasks.jsonl"
    tasks_file.write_text("".join(json.dumps({"id": t.id}) + "\n" for t in TASKS))
    async with contextlib.AsyncExitStack() as stack:
        engine = await stack.enter_async_context(
            EngineServer(EngineConfig(model=MODEL, bad_tool_args=0.4))
        )
        sock = socket.socket()
        stack.callback(sock.close)
        sock.bind(("127.0.0.1", 0))
        settings = Settings(
            upstream=[engine.url],
            data_dir=str(data_dir),
            port=sock.getsockname()[1],
            upstream_flavor="vllm",
            admin_token=secrets.token_urlsafe(32),
        )
        await upgrade_async(settings.database_url)
        proxy = web.AppRunner(build_app(settings), access_log=None)
        await proxy.setup()
        up = [True]

        async def stop_proxy() -> None:
            if up.pop() if up else False:
                await proxy.cleanup()  # drains the writer: every record is committed

        stack.push_async_callback(stop_proxy)
        await web.SockSite(proxy, sock).start()
        print(
            f"  engine  mock engine at {engine.url} (40% of tool calls get invalid "
            "arguments; the agent fails on them)"
        )
        print(
            f"  proxy   tracetap at {settings.base_url}; the engineer is called through "
            "it too (scripted: the engine answers given text)"
        )
        admin = AdminClient(settings.base_url, settings.admin_token)
        stack.push_async_callback(admin.close)
        harness = (
            f"{sys.executable} -m tracetap.demo.agent_command {{base_url}} {{task.id}} {{repeat}}"
        )
        options = Options(
            run_id="demo",
            model=MODEL,
            candidates=len(CANDIDATES),
            penalty=-1.0,
            guard=2,
            batch_packets=True,
            max_packets=3,
            concurrency=8,
            repeats=2,
            scripted=CANDIDATES,
        )
        rows = await engineer(
            settings.database_url,
            plan.read_tasks(tasks_file),
            Commands(harness=harness, harness_name="scripted-agent"),
            options,
            admin,
            admin,
            readers=readers(),
        )
        print()
        print(render(rows, options.penalty))
        await stop_proxy()  # every record committed before the export reads them
        summary = await export_async(settings.database_url, data_dir / "export", overwrite=True)
        print(
            f"\nexported {summary.episodes} episodes to {data_dir / 'export'}: the "
            f"engineer's {len(rows)} episodes are one group ({rows[0].group}), "
            "rewards = Δ_B or the penalty, ready for GRPO"
        )
    return rows
