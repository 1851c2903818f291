"""An upstream between tracetap and the mock engine that makes Claude Code's Agent tool
call start a real sub-agent.

The mock engine calls the first tool a harness offers with arguments drawn from its
schema; Claude Code's first tool is Agent, whose ``subagent_type`` is a free string, so
the drawn type does not exist (and half the time the agent would run in the background,
after the run has ended). Here the engine is shown that schema with the type fixed to
``general-purpose`` and ``run_in_background`` to false. It sees the steered schema on
every call of the run, so its token ids stay consistent from turn to turn; tracetap
stores what Claude Code sent.

It also ends a Codex run after its auto-compaction: the turn that starts from Codex's
summary (its user message begins with ``CODEX_SUMMARY``) is answered in text. The mock
engine calls a tool while the conversation holds fewer tool results than its rounds, and
a compacted history holds none, so under a small ``model_auto_compact_token_limit``
every new tool round would compact again, without end.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

_DROPPED = ("model", "effort", "isolation", "name", "team_name", "mode")
CODEX_SUMMARY = "Another language model started to solve this problem"


def steered(body: dict[str, Any]) -> dict[str, Any]:
    if any(isinstance(m, dict) and m.get("role") == "user"
           and CODEX_SUMMARY in json.dumps(m.get("content")) for m in body.get("messages") or []):
        body["mock_tool_rounds"] = 0
    for tool in body.get("tools") or []:
        spec = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        if spec.get("name") != "Agent":
            continue
        schema = spec.get("parameters") if "parameters" in spec else spec.get("input_schema")
        properties = schema.setdefault("properties", {})
        properties["subagent_type"] = {"type": "string", "enum": ["general-purpose"]}
        properties["run_in_background"] = {"const": False}
        for name in _DROPPED:
            properties.pop(name, None)
        schema["required"] = sorted({*(schema.get("required") or ()), "subagent_type",
                                     "run_in_background"})
    return body


def app(engine_url: str) -> web.Application:
    base = "{0.scheme}://{0.netloc}".format(urlsplit(engine_url))

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            body = json.dumps(steered(json.loads(body))).encode()
        except (ValueError, AttributeError, TypeError):
            pass  # not a JSON object with tools: as it came
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "content-length")}
        async with aiohttp.ClientSession() as session, session.request(
                request.method, base + request.path_qs, data=body, headers=headers) as reply:
            out = web.StreamResponse(status=reply.status, headers={
                "Content-Type": reply.headers.get("Content-Type", "application/json")})
            await out.prepare(request)
            async for chunk in reply.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    steering = web.Application(client_max_size=64 << 20)
    steering.router.add_route("*", "/{tail:.*}", relay)
    return steering
