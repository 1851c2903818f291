"""An episode's conversation, read back from one stored call: the task and its steps.

The last call's request holds everything the harness sent (system prompt, user task,
tools, every action and observation so far) and its response the final action. Chat
Completions bodies are read as they are; the engine's view (``upstream_request``, chat)
is preferred when the proxy translated the call; Anthropic Messages (tool_use /
tool_result blocks) and Responses (``input`` items) bodies are read natively.

A step is one assistant action (its text and tool calls) and the observations that
followed it (tool results, or user turns the harness added). Every text is cut to a
budget, keeping its head and tail around an explicit marker.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET

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


def read(
    request: str | None, upstream_request: str | None, response: str | None, budget: int
) -> tuple[Task, list[Step]]:
    body = _body(upstream_request) or _body(request) or _Body()
    messages = _messages(body)
    final = _final_message(json_object(response))
    if final is not None:
        messages = [*messages, _message(final)]
    task = Task(tools=[_tool(t) for t in body.tools or ()])
    steps: list[Step] = []
    names: dict[Any, Any] = {}  # tool call id -> tool name
    for m in messages:
        role = m.role
        if role in ("system", "developer") and task.system is None and not steps:
            task.system = cut(_text(m.content), budget)
        elif role == "assistant":
            steps.append(_action(m, len(steps), names, budget))
        elif role == "user" and task.user is None and not steps:
            task.user = cut(_text(m.content), budget)
        elif role in ("user", "tool") and steps:
            steps[-1].observations += _observations(m, names, budget)
    return task, steps


def _messages(body: _Body) -> list[_Message]:
    """The request's conversation as chat messages, whichever API it speaks."""
    if body.input is not UNSET or body.instructions is not UNSET:
        return [_message(m) for m in _responses_messages(body.input, body.instructions)]
    messages = body.messages or []
    if body.system is not None:
        messages = [_Message(role="system", content=body.system), *messages]
    return messages


# The few fields a conversation is read from, decoded straight into structs: a request
# resends the whole conversation, and generic dicts of it cost 2-3x the time (and GC).


class _Part(msgspec.Struct, gc=False):
    """A content block: text, Messages' tool_use / tool_result."""

    type: Any = None
    text: Any = None
    id: Any = None
    name: Any = None
    input: Any = None
    tool_use_id: Any = None
    content: str | list[_Part] | None = None


class _Function(msgspec.Struct, gc=False):
    name: Any = None
    arguments: Any = None


class _ToolCall(msgspec.Struct, gc=False):
    id: Any = None
    function: _Function | None = None


class _Message(msgspec.Struct, gc=False):
    role: Any = None
    content: str | list[_Part] | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: Any = None


class _Spec(msgspec.Struct, gc=False):
    name: Any = None
    description: Any = None
    parameters: Any = UNSET
    input_schema: Any = None


class _Tool(_Spec, gc=False):
    function: _Spec | None = None


class _Body(msgspec.Struct, gc=False):
    messages: list[_Message] | None = None
    system: str | list[_Part] | None = None  # Messages
    tools: list[_Tool] | None = None
    input: Any = UNSET  # Responses
    instructions: Any = UNSET


_BODY = msgspec.json.Decoder(_Body)
_EMPTY = _Body()


def _body(text: str | None) -> _Body | None:
    """A request body; None when it is missing, not JSON, or not a non-empty object."""
    if not text:
        return None
    try:
        body = _BODY.decode(text)
    except msgspec.ValidationError:  # a shape off the typed path: read it leniently
        value = json_object(text)
        return _lenient_body(value) if value else None
    except msgspec.DecodeError:
        return None
    if body == _EMPTY and not json_object(text):
        return None
    return body


def _lenient_body(body: dict[str, Any]) -> _Body:
    """The typed body from a decoded object of any shape: what the reading ignores
    (non-object messages, parts and tools; content of other types) is dropped."""
    messages, tools, system = body.get("messages"), body.get("tools"), body.get("system")
    return _Body(
        messages=[_message(m) for m in messages if isinstance(m, dict)]
        if isinstance(messages, list)
        else None,
        system=_parts(system),
        tools=[_lenient_tool(t) for t in tools if isinstance(t, dict)]
        if isinstance(tools, list)
        else None,
        input=body.get("input", UNSET),
        instructions=body.get("instructions", UNSET),
    )


def _lenient_tool(tool: dict[str, Any]) -> _Tool:
    spec = tool.get("function")
    return _Tool(
        name=tool.get("name"),
        description=tool.get("description"),
        parameters=tool.get("parameters", UNSET),
        input_schema=tool.get("input_schema"),
        function=_lenient_tool(spec) if isinstance(spec, dict) else None,
    )


def _message(m: dict[str, Any]) -> _Message:
    calls = m.get("tool_calls")
    return _Message(
        role=m.get("role"),
        content=_parts(m.get("content")),
        tool_calls=[
            _ToolCall(id=c.get("id"), function=_function(c.get("function")))
            for c in calls
            if isinstance(c, dict)
        ]
        if isinstance(calls, list)
        else None,
        tool_call_id=m.get("tool_call_id"),
    )


def _function(fn: Any) -> _Function | None:
    if not isinstance(fn, dict):
        return None
    return _Function(name=fn.get("name"), arguments=fn.get("arguments"))


def _parts(content: Any) -> str | list[_Part] | None:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    return [
        _Part(
            type=p.get("type"),
            text=p.get("text"),
            id=p.get("id"),
            name=p.get("name"),
            input=p.get("input"),
            tool_use_id=p.get("tool_use_id"),
            content=_parts(p.get("content")),
        )
        for p in content
        if isinstance(p, dict)
    ]


def json_object(text: str | None) -> dict[str, Any]:
    """A stored JSON text as an object; ``{}`` when it is empty, broken or not an object."""
    if not text:
        return {}
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _text(content: str | list[_Part] | None) -> str | None:
    if content is None or isinstance(content, str):
        return content
    texts = [p.text for p in content if p.type in ("text", "input_text", "output_text")]
    return "".join(t for t in texts if isinstance(t, str)) or None


def _tool(tool: _Tool) -> dict[str, Any]:
    spec = tool.function or tool
    return {
        "name": spec.name,
        "description": spec.description,
        "parameters": spec.input_schema if spec.parameters is UNSET else spec.parameters,
    }


def _action(m: _Message, index: int, names: dict[Any, Any], budget: int) -> Step:
    calls = []
    for c in m.tool_calls or ():  # chat
        fn = c.function or _NO_FUNCTION
        names[c.id] = fn.name
        calls.append({"name": fn.name, "arguments": cut(fn.arguments, budget)})
    content = m.content
    for block in content if isinstance(content, list) else ():  # messages: tool_use
        if block.type == "tool_use":
            names[block.id] = block.name
            arguments = msgspec.json.encode(block.input, order="sorted").decode()
            calls.append({"name": block.name, "arguments": cut(arguments, budget)})
    return Step(index=index, text=cut(_text(content), budget), tool_calls=calls)


_NO_FUNCTION = _Function()


def _observations(m: _Message, names: dict[Any, Any], budget: int) -> list[dict]:
    if m.role == "tool":
        return [
            {
                "source": "tool",
                "name": names.get(m.tool_call_id),
                "content": cut(_text(m.content), budget),
            }
        ]
    content = m.content
    results = (
        [b for b in content if b.type == "tool_result"] if isinstance(content, list) else []
    )
    if results:  # messages: tool results come back in a user turn
        return [
            {
                "source": "tool",
                "name": names.get(b.tool_use_id),
                "content": cut(_text(b.content), budget),
            }
            for b in results
        ]
    return [{"source": "user", "name": None, "content": cut(_text(content), budget)}]


def _responses_messages(items: Any, instructions: Any = None) -> list[dict[str, Any]]:
    """Responses ``input`` items (and ``instructions``) as chat messages."""
    messages: list[dict[str, Any]] = []
    if isinstance(instructions, str):
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    for item in items if isinstance(items, list) else ():
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append({"role": item.get("role"), "content": item.get("content")})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            last = messages[-1] if messages else {}
            if last.get("role") == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")}
            )
    return messages


def _final_message(response: dict[str, Any]) -> dict[str, Any] | None:
    choices = response.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        message = choices[0].get("message")
        return message if isinstance(message, dict) else None
    if response.get("type") == "message" and response.get("role") == "assistant":
        return {"role": "assistant", "content": response.get("content")}  # messages
    if isinstance(response.get("output"), list):  # responses
        turn = _responses_messages(response["output"])
        return turn[0] if turn and turn[0].get("role") == "assistant" else None
    return None
