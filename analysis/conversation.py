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

MARKER = "[... tracetap cut {} chars ...]"


class Task(msgspec.Struct, kw_only=True):
    system: str | None = None
    user: str | None = None
    tools: list[dict[str, Any]] = []  # {name, description, parameters}


class Step(msgspec.Struct, kw_only=True):
    index: int
    text: str | None = None
    tool_calls: list[dict[str, Any]] = []  # {name, arguments}
    observations: list[dict[str, Any]] = []  # {source: tool|user, name, content}
    call_id: str | None = None


def cut(text: str | None, budget: int) -> str | None:
    if text is None or len(text) <= budget:
        return text
    head = budget // 2
    tail = budget - head
    return text[:head] + MARKER.format(len(text) - budget) + (text[-tail:] if tail else "")


def read(
    request: str | None, upstream_request: str | None, response: str | None, budget: int
) -> tuple[Task, list[Step]]:
    body = _object(upstream_request) or _object(request)
    if "input" in body or "instructions" in body:
        messages = _responses_messages(body)
    else:
        messages = body.get("messages") if isinstance(body.get("messages"), list) else []
        if isinstance(body.get("system"), (str, list)):
            messages = [{"role": "system", "content": body["system"]}, *messages]
    final = _final_message(_object(response))
    if final is not None:
        messages = [*messages, final]
    task = Task(tools=[_tool(t) for t in body.get("tools") or () if isinstance(t, dict)])
    steps: list[Step] = []
    names: dict[str, str] = {}  # tool call id -> tool name
    for m in messages:
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        if role in ("system", "developer") and task.system is None and not steps:
            task.system = cut(_text(m.get("content")), budget)
        elif role == "assistant":
            steps.append(_action(m, len(steps), names, budget))
        elif role == "user" and task.user is None and not steps:
            task.user = cut(_text(m.get("content")), budget)
        elif role in ("user", "tool") and steps:
            steps[-1].observations += _observations(m, names, budget)
    return task, steps


def _object(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [
            p.get("text")
            for p in content
            if isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text")
        ]
        return "".join(t for t in texts if isinstance(t, str)) or None
    return None


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    spec = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    return {
        "name": spec.get("name"),
        "description": spec.get("description"),
        "parameters": spec.get("parameters", spec.get("input_schema")),
    }


def _action(m: dict[str, Any], index: int, names: dict[str, str], budget: int) -> Step:
    calls = []
    for c in m.get("tool_calls") or ():  # chat
        fn = c.get("function") or {}
        names[c.get("id")] = fn.get("name")
        calls.append({"name": fn.get("name"), "arguments": cut(fn.get("arguments"), budget)})
    content = m.get("content")
    for block in content if isinstance(content, list) else ():  # messages: tool_use
        if isinstance(block, dict) and block.get("type") == "tool_use":
            names[block.get("id")] = block.get("name")
            arguments = msgspec.json.encode(block.get("input"), order="sorted").decode()
            calls.append({"name": block.get("name"), "arguments": cut(arguments, budget)})
    return Step(index=index, text=cut(_text(content), budget), tool_calls=calls)


def _observations(m: dict[str, Any], names: dict[str, str], budget: int) -> list[dict]:
    if m.get("role") == "tool":
        return [
            {
                "source": "tool",
                "name": names.get(m.get("tool_call_id")),
                "content": cut(_text(m.get("content")), budget),
            }
        ]
    content = m.get("content")
    results = (
        [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]
        if isinstance(content, list)
        else []
    )
    if results:  # messages: tool results come back in a user turn
        return [
            {
                "source": "tool",
                "name": names.get(b.get("tool_use_id")),
                "content": cut(_text(b.get("content")), budget),
            }
            for b in results
        ]
    return [{"source": "user", "name": None, "content": cut(_text(content), budget)}]


def _responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Responses ``input`` items as chat messages."""
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
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
        turn = _responses_messages({"input": response["output"]})
        return turn[0] if turn and turn[0].get("role") == "assistant" else None
    return None
