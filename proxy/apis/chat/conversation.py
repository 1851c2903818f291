"""Chat completions and legacy completions requests and replies read as a conversation
(``storage.conversation``): messages with their content parts, ``tool_calls`` and
``reasoning_content``; a ``tool`` message is a tool result."""

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
CHAT_SHAPE = Shape(messages="messages")
COMPLETIONS_SHAPE = Shape(prompt="prompt")


def read_chat(request: Mapping[str, Any], reply: Mapping[str, Any], *,
              first: int | None = None) -> Conversation:
    messages = request.get("messages")
    if isinstance(messages, list) and first is not None:
        messages = messages[:first]
    answers = [c.get("message") for c in reply.get("choices") or () if isinstance(c, dict)]
    return Conversation(
        messages=[message(m) for m in messages] if isinstance(messages, list) else None,
        reply=[message(m) for m in answers if isinstance(m, dict)],
        tools=[tool(t) for t in request.get("tools") or () if isinstance(t, dict)])


def read_completions(request: Mapping[str, Any], reply: Mapping[str, Any], *,
                     first: int | None = None) -> Conversation:
    return Conversation(
        prompt=parts(request.get("prompt")),
        reply=[Message(role="reply", parts=parts(c.get("text")))
               for c in reply.get("choices") or () if isinstance(c, dict)])


def chat_caps(request: Mapping[str, Any]) -> Caps:
    return read_caps(request, ("max_completion_tokens", "max_tokens"), "n")


def completions_caps(request: Mapping[str, Any]) -> Caps:
    return read_caps(request, ("max_tokens",), "n")


def message(m: Any) -> Message:
    if not isinstance(m, dict):
        return Message(role="other", parts=[Other(value=m)])
    role = str(m.get("role", "other"))
    content = parts(m.get("content"))
    if role == "tool":
        return Message(role=role, parts=[ToolResult(call_id=m.get("tool_call_id"),
                                                    parts=content)])
    reasoning = m.get("reasoning_content") or m.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        content.insert(0, Reasoning(reasoning))
    calls = m.get("tool_calls")
    for c in calls if isinstance(calls, list) else ():
        if isinstance(c, dict):
            fn = c.get("function")
            fn = fn if isinstance(fn, dict) else {}
            content.append(ToolCall(name=_str(fn.get("name")), arguments=fn.get("arguments"),
                                    id=_str(c.get("id"))))
    return Message(role=role, parts=content)


def parts(content: Any) -> list[Part]:
    """A content value (a string, or a list of parts) as parts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [Text(content)]
    if isinstance(content, list):
        return [_part(p) for p in content]
    return [Other(value=content)]


def _part(p: Any) -> Part:
    if not isinstance(p, dict):  # a bare string is no content part: kept, not read as text
        return Other(value=p)
    if isinstance(p.get("text"), str):
        return Text(p["text"])
    kind = str(p.get("type", ""))
    if kind in ("image_url", "input_image"):  # chat; Responses
        url = p.get("image_url")
        return image(p, kind, url.get("url") if isinstance(url, dict) else url)
    return Other(value=p, block=kind)


def tool(t: Mapping[str, Any]) -> Tool:
    spec = t.get("function")
    spec = spec if isinstance(spec, dict) else t
    return Tool(name=spec.get("name"), description=spec.get("description"),
                parameters=spec.get("parameters"))


def _str(value: Any) -> str | None:
    return None if value is None else str(value)
