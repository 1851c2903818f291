"""Harness styles seen in the wild, as functions of the true history, and an episode runner.

Each style takes the conversation as the model returned it and gives what that harness
resends: langchain-openai re-serialises tool arguments, smolagents sends the assistant
turn as text parts with its tool calls written out, some harnesses strip whitespace, drop
a turn or summarise their history.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

import openai

SYSTEM = {"role": "system", "content": "Use the tool, then answer."}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]

Style = Callable[[list[dict]], list[dict]]


def faithful(history: list[dict]) -> list[dict]:
    return copy.deepcopy(history)


def reserialized(history: list[dict]) -> list[dict]:
    """langchain-openai: arguments parsed and dumped again, ``{"q": "x"}`` with spaces."""
    out = copy.deepcopy(history)
    for message in out:
        for call in message.get("tool_calls") or ():
            call["function"]["arguments"] = json.dumps(json.loads(call["function"]["arguments"]))
    return out


def stripped(history: list[dict]) -> list[dict]:
    """Assistant text with its trailing whitespace stripped."""
    out = copy.deepcopy(history)
    for message in out:
        if message["role"] == "assistant" and isinstance(message.get("content"), str):
            message["content"] = message["content"].rstrip()
    return out


def text_parts(history: list[dict]) -> list[dict]:
    """smolagents: the turn as text parts, its tool calls written out, no tool_calls."""
    out = []
    for message in copy.deepcopy(history):
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = [{"id": c["id"], "type": "function",
                      "function": {"name": c["function"]["name"],
                                   "arguments": json.loads(c["function"]["arguments"])}}
                     for c in message["tool_calls"]]
            message = {"role": "assistant", "content": [
                {"type": "text", "text": message.get("content") or ""},
                {"type": "text", "text": "Calling tools:\n" + repr(calls)}]}
        out.append(message)
    return out


def dropped(history: list[dict]) -> list[dict]:
    """The model's turns and their tool results left out; the user asks to continue."""
    kept = [m for m in copy.deepcopy(history) if m["role"] in ("system", "user")]
    return kept + ([{"role": "user", "content": "Continue."}] if len(kept) < len(history)
                   else [])


def summarised(history: list[dict]) -> list[dict]:
    """Everything after the system message replaced by one summary."""
    if len(history) <= 2:
        return copy.deepcopy(history)
    notes = " ".join(str(m.get("content")) for m in history if m["role"] == "tool")
    return [copy.deepcopy(history[0]),
            {"role": "user", "content": f"Summary so far: {notes}. Finish the task."}]


def run_episode(proxy, episode: str, style: Style, *, turns: int = 3, tools=TOOLS,
                extra: dict | None = None, stop: list[str] | None = None,
                system: dict = SYSTEM, task: str | None = None) -> list[dict]:
    """Drive one episode with the openai SDK; returns the true history."""
    client = openai.OpenAI(base_url=proxy.episode_url(episode), api_key="x", max_retries=0)
    history = [system, {"role": "user", "content": f"Task {task or episode}."}]
    kwargs = {"tools": tools} if tools else {}
    if stop:
        kwargs["stop"] = stop
    with client:
        for _ in range(turns):
            reply = client.chat.completions.create(model="m", messages=style(history),
                                                   extra_body=extra, **kwargs)
            message = reply.choices[0].message
            assistant: dict = {"role": "assistant", "content": message.content}
            calls = [c.model_dump(include={"id", "type", "function"})
                     for c in message.tool_calls or ()]
            if calls:
                assistant["tool_calls"] = calls
            history.append(assistant)
            history += [{"role": "tool", "tool_call_id": c["id"], "content": "It is north."}
                        for c in calls]
            if not calls:
                history.append({"role": "user", "content": "Go on."})
    return history
