"""Overlays the tests load with --overlay tests.overlay_fixtures:NAME (operator code)."""

from __future__ import annotations

import asyncio

from tracetap.proxy.overlays.hooks import Inject, Rewrite, ToolCall, Veto

NOTE = "Overlay note: be brief."


class Noter:
    """Pre-decision: a note after the system prompt on the first call; starts with state."""

    async def on_episode_start(self, episode):
        return {"episode": episode.id, "task": episode.task_id, "calls": 0}

    async def before_model(self, request, state):
        state["calls"] += 1
        if state["calls"] == 1:
            return Inject(messages=[{"role": "system", "content": NOTE}], at="after_system",
                          reason="note")
        return None


class Rewriter:
    """Pre-action: every text answer is replaced; tool calls get step 1."""

    async def after_model(self, reply, state):
        if reply.tool_calls:
            return Rewrite(content=reply.content, reason="step 1", tool_calls=[
                ToolCall(id=c.id, name=c.name, arguments='{"step":1}') for c in reply.tool_calls])
        return Rewrite(content="Rewritten by the overlay.", reason="house style")


class FirstVetoer:
    """Pre-action: the first sample of every turn is rejected."""

    async def after_model(self, reply, state):
        if reply.attempt == 0:
            return Veto(feedback="Try once more.", reason="first attempt")
        return None


class Raiser:
    async def on_episode_start(self, episode):
        raise RuntimeError("start broke")

    async def before_model(self, request, state):
        raise RuntimeError("before broke")

    async def after_model(self, reply, state):
        raise RuntimeError("after broke")

    async def on_observation(self, observations, state):
        raise RuntimeError("observation broke")


class Sleeper:
    """Every hook outlasts any budget the tests give (it is cancelled, never awaited out)."""

    async def before_model(self, request, state):
        await asyncio.sleep(3600)

    async def after_model(self, reply, state):
        await asyncio.sleep(3600)


def noter():
    return Noter()


def rewriter():
    return Rewriter()


def first_vetoer():
    return FirstVetoer()


def raiser():
    return Raiser()


def sleeper():
    return Sleeper()


def not_async():
    class Blocking:
        def before_model(self, request, state):
            return None

    return Blocking()
