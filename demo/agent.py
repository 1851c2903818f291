"""A scripted tool-using agent on the real ``openai`` SDK, as a harness would drive tracetap.

The agent knows nothing about tracetap: it gets an OpenAI base URL and a key. Each turn it
calls chat.completions with a ``lookup`` tool, appends the assistant message exactly as
returned (tool calls included) and one tool result per call, until the model answers
without a tool call. A tool call whose arguments do not fit the tool's schema fails the
episode (``failure``), as a strict harness would. ``rewrite_at`` makes it rewrite its
context before that turn (the old turns are summarised into one new user message), as
long-horizon harnesses do.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from openai import AsyncOpenAI

SYSTEM = "You are a careful research agent. Use the lookup tool, then answer in one sentence."
MAX_TURNS = 16  # a guard: the demo engine answers after its tool rounds
TOOLS = [{
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up one numbered fact about the task's subject.",
        "parameters": {"type": "object", "properties": {"step": {"type": "integer"}},
                       "required": ["step"]},
    },
}]
_FACTS = ("is north of the river", "is built of grey stone", "has a quiet harbor",
          "keeps a lantern lit", "was mapped on paper", "sends a signal at morning")


@dataclass(frozen=True)
class Task:
    id: str
    subject: str
    keywords: frozenset[str]  # an answer mentioning these words scores

    @property
    def question(self) -> str:
        return f"What do we know about {self.subject}? Look it up, then answer."


TASKS = (
    Task("lighthouse", "the old lighthouse", frozenset({"lantern", "signal", "stone"})),
    Task("harbor-town", "the harbor town", frozenset({"harbor", "river", "quiet"})),
    Task("forest-path", "the forest path", frozenset({"forest", "north", "gentle"})),
    Task("orchard", "the orange orchard", frozenset({"orange", "garden", "morning"})),
)


@dataclass
class Turn:
    streamed: bool
    tool_calls: list[dict[str, Any]]
    content: str | None


@dataclass
class AgentRun:
    task: Task
    turns: list[Turn] = field(default_factory=list)
    rewritten_at: int | None = None
    failure: str | None = None  # why the episode failed (invalid tool arguments)

    @property
    def answer(self) -> str:
        return (self.turns[-1].content or "") if self.turns else ""

    @property
    def lookups(self) -> int:
        return sum(len(t.tool_calls) for t in self.turns)

    def reward(self) -> float:
        """Deterministic: half a point per task keyword in the answer, at most 1."""
        if self.failure is not None:
            return 0.0
        words = {w.strip(".,;:!?").lower() for w in self.answer.split()}
        return min(1.0, 0.5 * len(words & self.task.keywords))

    def outcome(self) -> str:
        reward = self.reward()
        return "solved" if reward >= 1.0 else "partial" if reward > 0 else "failed"


def invalid_arguments(call: dict[str, Any]) -> str | None:
    """Why a tool call does not fit ``TOOLS`` (None when it does)."""
    function = call.get("function") or {}
    if function.get("name") != "lookup":
        return f"unknown tool {function.get('name')!r}"
    try:
        arguments = json.loads(function.get("arguments") or "")
    except ValueError:
        return "arguments are not JSON"
    if not isinstance(arguments, dict) or type(arguments.get("step")) is not int:
        return f"'step' must be an integer, got {function.get('arguments')}"
    return None


def lookup(task: Task, arguments: str) -> str:
    """The tool, implemented locally and deterministically."""
    try:
        step = int(json.loads(arguments).get("step", 0))
    except (ValueError, TypeError, AttributeError):
        return "error: arguments must be a JSON object with an integer 'step'"
    digest = hashlib.sha256(f"{task.id}:{step}".encode()).digest()
    return f"Fact {step}: {task.subject} {_FACTS[digest[0] % len(_FACTS)]}."


async def run_agent(client: AsyncOpenAI, task: Task, *, model: str, seed: int = 0,
                    rewrite_at: int | None = None, extra_body: dict | None = None) -> AgentRun:
    """Run one episode to its final answer; every other turn streams."""
    run = AgentRun(task)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": task.question}]
    for number in range(1, MAX_TURNS + 1):
        if number == rewrite_at:
            messages = _summarised(messages, task)
            run.rewritten_at = number
        streamed = number % 2 == 0
        turn = await _call(client, messages, model=model, seed=seed, stream=streamed,
                           extra_body=extra_body)
        run.turns.append(turn)
        assistant: dict[str, Any] = {"role": "assistant", "content": turn.content}
        if turn.tool_calls:
            assistant["tool_calls"] = turn.tool_calls
        messages.append(assistant)
        if not turn.tool_calls:
            return run
        for call in turn.tool_calls:
            run.failure = invalid_arguments(call)
            if run.failure is not None:
                return run
        for call in turn.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": lookup(task, call["function"]["arguments"])})
    raise RuntimeError(f"the agent gave up on {task.id!r} after {MAX_TURNS} turns")


def _summarised(messages: list[dict[str, Any]], task: Task) -> list[dict[str, Any]]:
    """Drop the old turns; keep what the tools said, in one new user message."""
    notes = " ".join(m["content"] for m in messages if m["role"] == "tool")
    summary = f"{task.question}\nNotes from earlier lookups: {notes or 'none yet.'}"
    return [messages[0], {"role": "user", "content": summary}]


async def _call(client: AsyncOpenAI, messages: list[dict[str, Any]], *, model: str, seed: int,
                stream: bool, extra_body: dict | None) -> Turn:
    kwargs = dict(model=model, messages=messages, tools=TOOLS, seed=seed,
                  extra_body=extra_body or None)
    if not stream:
        reply = await client.chat.completions.create(**kwargs)
        message = reply.choices[0].message
        calls = [c.model_dump(include={"id", "type", "function"})
                 for c in message.tool_calls or ()]
        return Turn(False, calls, message.content)
    content, tools = "", {}
    chunks = await client.chat.completions.create(**kwargs, stream=True)
    async with chunks:
        async for chunk in chunks:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for call in choice.delta.tool_calls or ():
                    tool = tools.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                    tool["id"] = call.id or tool["id"]
                    if call.function is not None:
                        tool["name"] += call.function.name or ""
                        tool["arguments"] += call.function.arguments or ""
    calls = [{"id": t["id"], "type": "function",
              "function": {"name": t["name"], "arguments": t["arguments"]}}
             for _, t in sorted(tools.items())]
    return Turn(True, calls, content or None)
