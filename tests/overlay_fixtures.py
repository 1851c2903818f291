"""Overlays the tests load with --overlay tests.overlay_fixtures:NAME (operator code)."""

from __future__ import annotations

import asyncio
import threading

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


class LongVetoer:
    """Pre-action: every first sample rejected, with a reason longer than the record keeps."""

    async def after_model(self, reply, state):
        if reply.attempt == 0:
            return Veto(feedback="Try once more.", reason="why " * 500)
        return None


class VetoThenRaise:
    """Pre-action: the first sample rejected, then the judgment of the re-sample fails."""

    async def after_model(self, reply, state):
        if reply.attempt == 0:
            return Veto(feedback="Try once more.", reason="first attempt")
        raise RuntimeError("second judgment broke")


class GatedToolVetoer:
    """Pre-action on tool calls only: the first sample of a turn is vetoed. The hook first
    waits for the test to open ``gate``, which the test does once its client got text:
    ``opened`` says, per call of the hook, whether the text had reached the client."""

    after_model_sees = "tool_calls"

    def __init__(self):
        self.gate = threading.Event()
        self.opened: list[bool] = []

    async def after_model(self, reply, state):
        self.opened.append(await asyncio.to_thread(self.gate.wait, 5))
        if reply.attempt == 0:
            return Veto(feedback="Try once more.", reason="first attempt")
        return None


class ToolRewriter(Rewriter):
    """``rewriter`` on tool calls only: its content cannot replace text already sent."""

    after_model_sees = "tool_calls"


class ToolRaiser:
    after_model_sees = "tool_calls"

    async def after_model(self, reply, state):
        raise RuntimeError("after broke")


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


def long_vetoer():
    return LongVetoer()


def veto_then_raise():
    return VetoThenRaise()


def gated_tool_vetoer():
    return GatedToolVetoer()


def tool_rewriter():
    return ToolRewriter()


def tool_raiser():
    return ToolRaiser()


def raiser():
    return Raiser()


def sleeper():
    return Sleeper()


def not_async():
    class Blocking:
        def before_model(self, request, state):
            return None

    return Blocking()


def sees_everything():
    class Unknown(FirstVetoer):
        after_model_sees = "everything"

    return Unknown()
