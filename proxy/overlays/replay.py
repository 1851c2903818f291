"""A patch's hooks replayed on an episode's recorded calls, in a worker of its own (the
sandbox every patch runs in, ``overlays.workers``), each within a budget:
``POST /tracetap/overlays/NAME/replay``. ``tracetap engineer`` validates a candidate
this way on its failure packet's episode before any batch runs with it: a hook that
raises, returns the wrong type or runs past its budget on a recorded call is why the
candidate is invalid."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from tracetap.proxy.overlays import frames
from tracetap.proxy.overlays.hooks import (
    EpisodeInfo,
    ModelReply,
    ModelRequest,
    Observation,
    ToolCall,
)
from tracetap.proxy.overlays.workers import Worker, WorkerDied


async def replay(
    worker: Worker,
    episode: EpisodeInfo,
    calls: list[dict[str, Any]],
    budget: float,
) -> tuple[str | None, int]:
    """(None when every hook ran on every call within ``budget`` seconds, else why not;
    how many hooks ran). ``worker`` is new (``Patches.worker``), and killed here; a
    worker that cannot start at all raises WorkerRefused."""
    ran = 0
    try:
        try:
            loaded = await worker.load()
        except ValueError as exc:
            return f"does not load: {exc}", ran
        start = frames.Call(id=0, hook="on_episode_start", episode=episode.id, start=episode)
        checked = [start] if "on_episode_start" in loaded.hooks else []
        for call in calls:
            checked += _hooks(call, episode.id, loaded.hooks)
        for call in checked:
            try:
                answer = await asyncio.wait_for(worker.call(call, start), budget)
            except asyncio.TimeoutError:
                return f"{call.hook} ran past its {budget:g} s budget on a recorded call", ran
            except WorkerDied as exc:
                return f"{call.hook}: its worker died ({exc})", ran
            ran += 1
            if answer.kind == "error":
                return f"{call.hook} failed on a recorded call: {answer.error}", ran
            try:
                frames.result(answer)
            except ValueError as exc:
                return f"{call.hook}: {exc}", ran
        return None, ran
    finally:
        await worker.kill()


def _hooks(call: dict[str, Any], episode: str, hooks: list[str]) -> list[frames.Call]:
    """The hook calls one recorded model call gives (those the patch defines)."""
    request = _json(call.get("request"))
    if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
        return []  # not chat-shaped: no hook runs on it in the proxy either
    messages, tools = request["messages"], request.get("tools")
    out = []
    observations = _observations(messages)
    if "on_observation" in hooks and observations:
        out.append(
            frames.Call(id=0, hook="on_observation", episode=episode, observations=observations)
        )
    if "before_model" in hooks:
        out.append(
            frames.Call(
                id=0,
                hook="before_model",
                episode=episode,
                request=ModelRequest(model=request.get("model"), messages=messages, tools=tools),
            )
        )
    reply = _reply(_json(call.get("response")), tools)
    if "after_model" in hooks and reply is not None:
        out.append(frames.Call(id=0, hook="after_model", episode=episode, reply=reply))
    return out


def _observations(messages: list[Any]) -> list[Observation]:
    start = len(messages)
    while (
        start > 0
        and isinstance(messages[start - 1], dict)
        and messages[start - 1].get("role") == "tool"
    ):
        start -= 1
    return [
        Observation(
            tool_call_id=m.get("tool_call_id"),
            name=None,
            content=m["content"] if isinstance(m.get("content"), str) else "",
        )
        for m in messages[start:]
    ]


def _reply(response: Any, tools: Any) -> ModelReply | None:
    try:
        choice = response["choices"][0]
        message = choice["message"]
        calls = [
            ToolCall(
                id=c.get("id"),
                name=c["function"].get("name"),
                arguments=c["function"].get("arguments") or "",
            )
            for c in message.get("tool_calls") or ()
        ]
        return ModelReply(
            content=message.get("content"),
            tool_calls=calls,
            finish_reason=choice.get("finish_reason"),
            tools=tools,
            attempt=0,
        )
    except (KeyError, IndexError, TypeError, AttributeError):
        return None  # a stream's record, an error reply: nothing the hook would judge


def _json(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return None
