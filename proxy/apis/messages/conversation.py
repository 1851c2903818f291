"""Anthropic Messages requests and replies read as a conversation
(``storage.conversation``): ``system`` is the system prompt; content blocks are text,
thinking (reasoning), ``tool_use`` (a tool call), ``tool_result`` (in a user turn) and
images."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tracetap.proxy.apis import Caps, read_caps
from tracetap.storage.conversation import (
    Conversation,
    Message,
    Other,
    Part,
    Reasoning,
    Shape,
    Text,
    Tool,
    ToolCall,
    ToolResult,
    image,
)

# Where storage finds the conversation in a stored request (``storage.conversation.Shape``).
MESSAGES_SHAPE = Shape(messages="messages", head=("system",))


def read_messages(request: Mapping[str, Any], reply: Mapping[str, Any], *,
                  first: int | None = None) -> Conversation:
    items = request.get("messages")
    if isinstance(items, list) and first is not None:
        items = items[:first]
    messages = [message(m) for m in items] if isinstance(items, list) else None
    system = request.get("system")
    if system and messages is not None:
        messages.insert(0, Message(role="system", parts=blocks(system)))
    answer = []
    if reply.get("content") is not None:
        answer = [Message(role=str(reply.get("role", "assistant")),
                          parts=blocks(reply["content"]))]
    tools = request.get("tools")
    return Conversation(
        messages=messages, reply=answer,
        tools=[Tool(name=t.get("name"), description=t.get("description"),
                    parameters=t.get("input_schema"))
               for t in tools if isinstance(t, dict)] if isinstance(tools, list) else [])


def messages_caps(request: Mapping[str, Any]) -> Caps:
    return read_caps(request, ("max_tokens",))  # no ``n``: one message


def message(m: Any) -> Message:
    if not isinstance(m, dict):
        return Message(role="other", parts=[Other(value=m)])
    return Message(role=str(m.get("role", "other")), parts=blocks(m.get("content")))


def blocks(content: Any) -> list[Part]:
    if content is None:
        return []
    if isinstance(content, str):
        return [Text(content)]
    if not isinstance(content, list):
        return [Other(value=content)]
    return [_block(b) for b in content]


def _block(block: Any) -> Part:
    if not isinstance(block, dict):
        return Text(block) if isinstance(block, str) else Other(value=block)
    kind = str(block.get("type", ""))
    if kind == "text" or (kind == "" and isinstance(block.get("text"), str)):
        return Text(str(block.get("text", "")))
    if kind == "thinking":
        return Reasoning(str(block.get("thinking", "")), block=kind)
    if kind == "tool_use":
        return ToolCall(name=_str(block.get("name")), arguments=block.get("input"),
                        id=_str(block.get("id")), block=kind)
    if kind == "tool_result":
        content = block.get("content")
        return ToolResult(call_id=_str(block.get("tool_use_id")),
                          parts=None if content is None else blocks(content), block=kind)
    if kind == "image":
        source = block.get("source")
        source = source if isinstance(source, dict) else {}
        return image(block, kind, source.get("url"))
    return Other(value=block, block=kind)


def _str(value: Any) -> str | None:
    return None if value is None else str(value)
