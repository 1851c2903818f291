"""Responses requests and replies read as a conversation (``storage.conversation``):
``instructions`` is the system prompt; ``input`` (a string, or items) and the reply's
``output`` items are messages, the assistant's items in a row (reasoning, its message,
its function calls) one assistant message."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tracetap.proxy.apis import Caps, read_caps
from tracetap.proxy.apis.chat.conversation import parts
from tracetap.storage.conversation import (
    Conversation,
    Message,
    Other,
    Reasoning,
    Shape,
    Text,
    Tool,
    ToolCall,
    ToolResult,
)

# Where storage finds the conversation in a stored request (``storage.conversation.Shape``):
# a function call is an item of its own, the model's as much as its message is.
RESPONSES_SHAPE = Shape(messages="input", head=("instructions",),
                        assistant_types=("function_call", "custom_tool_call"))


def read_responses(request: Mapping[str, Any], reply: Mapping[str, Any], *,
                   first: int | None = None) -> Conversation:
    messages = []
    instructions = request.get("instructions")
    if instructions:
        messages.append(Message(role="system", parts=parts(instructions)))
    items = request.get("input")
    if isinstance(items, str):
        messages.append(Message(role="user", parts=[Text(items)]))
    elif isinstance(items, list):
        messages += items_as_messages(items if first is None else items[:first])
    output = reply.get("output")
    tools = request.get("tools")
    return Conversation(
        messages=messages if isinstance(items, (str, list)) or instructions else None,
        reply=items_as_messages(output) if isinstance(output, list) else [],
        tools=[Tool(name=t.get("name"), description=t.get("description"),
                    parameters=t.get("parameters"))
               for t in tools if isinstance(t, dict)] if isinstance(tools, list) else [])


def responses_caps(request: Mapping[str, Any]) -> Caps:
    return read_caps(request, ("max_output_tokens",))  # no ``n``: one response


def items_as_messages(items: list[Any]) -> list[Message]:
    out: list[Message] = []
    for item in items:
        one = _item(item)
        last = out[-1] if out else None
        if one.role == "assistant" and last is not None and last.role == "assistant":
            last.parts += one.parts  # the same assistant turn, item by item
        else:
            out.append(one)
    return out


def _item(item: Any) -> Message:
    if not isinstance(item, dict):
        return Message(role="other", parts=[Other(value=item)])
    kind = item.get("type", "message")
    if kind == "function_call":
        return Message(role="assistant", parts=[ToolCall(
            name=_str(item.get("name")), arguments=item.get("arguments"),
            id=_str(item.get("call_id")), block=kind)])
    if kind == "function_call_output":
        return Message(role="tool", parts=[ToolResult(
            call_id=_str(item.get("call_id")), parts=parts(item.get("output")), block=kind)])
    if kind == "reasoning":
        said = parts(item.get("summary") or item.get("content"))
        text = "\n".join(p.text for p in said if type(p) is Text)
        return Message(role="assistant", parts=[Reasoning(text, block=kind)])
    if kind == "message":
        return Message(role=str(item.get("role", "other")), parts=parts(item.get("content")))
    return Message(role="other", parts=[Other(value=item, block=str(kind))])


def _str(value: Any) -> str | None:
    return None if value is None else str(value)
