"""An episode's conversation, read back from one stored call: the task and its steps.

The last call's request holds everything the harness sent (system prompt, user task,
tools, every action and observation so far) and its response the final action. Each
API's reader (``storage.conversation.Readers``, handed in by the command) reads the
bodies as a conversation; the engine's view (``upstream_request``) is preferred when the
proxy translated or an overlay changed the call.

A step is one assistant action (its text and tool calls) and the observations that
followed it (tool results, or user turns the harness added). Every text is cut to a
budget, keeping its head and tail around an explicit marker.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tracetap.storage.conversation import (
    SYSTEM_ROLES,
    Conversation,
    Message,
    Readers,
    Tool,
    ToolCall,
    ToolResult,
    json_object,
    text_of,
)

MARKER = "[... tracetap cut {} chars ...]"


class Task(msgspec.Struct, kw_only=True, gc=False):
    system: str | None = None
    user: str | None = None
    tools: list[dict[str, Any]] = []  # {name, description, parameters}


class Step(msgspec.Struct, kw_only=True, gc=False):
    index: int
    text: str | None = None
    tool_calls: list[dict[str, Any]] = []  # {name, arguments}
    # {source: tool|user|system, name, content, injected}; injected: an overlay added it
    observations: list[dict[str, Any]] = []
    call_id: str | None = None
    overlay_events: list[dict[str, Any]] = []  # what an overlay did to this action's call


def cut(text: str | None, budget: int) -> str | None:
    if text is None or len(text) <= budget:
        return text
    head = budget // 2
    tail = budget - head
    return text[:head] + MARKER.format(len(text) - budget) + (text[-tail:] if tail else "")


def read(readers: Readers, endpoint: str, request: str | None, upstream_request: str | None,
         response: str | None, budget: int) -> tuple[Task, list[Step]]:
    body = conversation_of(readers, endpoint, request, upstream_request)
    messages = list(body.messages or ())
    final = final_message(readers, endpoint, response)
    if final is not None:
        messages.append(final)
    task = Task(tools=[tool(t) for t in body.tools])
    steps: list[Step] = []
    names: dict[Any, Any] = {}  # tool call id -> tool name
    for m in messages:
        role = m.role
        if role in SYSTEM_ROLES and task.system is None and not steps:
            task.system = cut(text(m), budget)
        elif role == "assistant":
            steps.append(action(m, len(steps), names, budget))
        elif role == "user" and task.user is None and not steps:
            task.user = cut(text(m), budget)
        elif role in ("user", "tool") and steps:
            steps[-1].observations += observations(m, names, budget)
    return task, steps


def conversation_of(readers: Readers, endpoint: str, request: str | None,
                    upstream_request: str | None) -> Conversation:
    """The request as the model was given it: ``upstream_request`` (in the upstream's API)
    when there is one, else the harness's own; empty when neither is a non-empty object."""
    upstream = json_object(upstream_request)
    if upstream:
        return readers.upstream_reader(endpoint)(upstream, {})
    sent = json_object(request)
    return readers.reader(endpoint)(sent, {}) if sent else Conversation()


def messages_of(readers: Readers, endpoint: str, request: str | None,
                upstream: bool = False) -> list[Message]:
    """One request's messages (``upstream``: read as the upstream's request)."""
    body = json_object(request)
    if not body:
        return []
    reader = readers.upstream_reader(endpoint) if upstream else readers.reader(endpoint)
    return reader(body, {}).messages or []


def final_message(readers: Readers, endpoint: str, response: str | None) -> Message | None:
    """The reply's (first) assistant message."""
    reply = readers.reader(endpoint)({}, json_object(response)).reply
    return reply[0] if reply and reply[0].role == "assistant" else None


def text(m: Message) -> str | None:
    return text_of(m.parts)


def tool(t: Tool) -> dict[str, Any]:
    return {"name": t.name, "description": t.description, "parameters": t.parameters}


def action(m: Message, index: int, names: dict[Any, Any], budget: int) -> Step:
    calls = []
    for c in m.parts:
        if type(c) is ToolCall:
            names[c.id] = c.name
            calls.append({"name": c.name, "arguments": cut(_arguments(c.arguments), budget)})
    return Step(index=index, text=cut(text(m), budget), tool_calls=calls)


def _arguments(value: Any) -> str | None:
    """As the API sent them: a JSON text as it is, a JSON value as sorted JSON."""
    if value is None or isinstance(value, str):
        return value
    return msgspec.json.encode(value, order="sorted").decode()


def observations(m: Message, names: dict[Any, Any], budget: int) -> list[dict]:
    results = [p for p in m.parts if type(p) is ToolResult]
    if results:  # a tool message (chat), or a user turn of tool results (Messages)
        return [{"source": "tool", "name": names.get(r.call_id),
                 "content": cut(text_of(r.parts), budget)} for r in results]
    return [{"source": "user", "name": None, "content": cut(text(m), budget)}]
