"""Anthropic Messages API (``POST /v1/messages``) of the mock engine, shaped like vLLM's.

As in vLLM, a request becomes the equivalent chat conversation first (``to_chat``), so it
gets the same tokens as that chat-completions request; and as in vLLM, the answer carries
no logprobs and no token ids. The mapping, for a proxy that translates to chat:

- ``system`` (a string, or text blocks joined with no separator) → a leading ``system``
  message; so do ``role: system`` entries of ``messages``.
- a string ``content`` → ``{"role", "content"}``; in block lists, text blocks are joined
  into ``content``, ``tool_use`` blocks become ``tool_calls`` ``{"id", "type": "function",
  "function": {"name", "arguments": canonical JSON of input}}``, each ``tool_result`` in a
  user turn becomes a ``{"role": "tool", "tool_call_id", "content"}`` message placed before
  the turn's text (a user turn with no text left is dropped); a user turn's ``image``
  block is its placeholder tokens (demo.tokenizer.IMAGE_TEXT) among the text; ``thinking``
  blocks are dropped.
- tools → ``{"type": "function", "function": {"name", "description" (when given),
  "parameters": input_schema}}``; ``tool_choice`` auto/any/none/tool → "auto"/"required"/
  "none"/``{"type": "function", "function": {"name"}}``.

Arguments are re-serialized canonically (sorted keys, no spaces: the spelling the mock
generates), so a tool round trip re-renders to the generated tokens. Real vLLM uses
``json.dumps`` (with spaces) there, which breaks that token prefix.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from tracetap.demo import tokenizer as tok
from tracetap.demo.generate import Completion
from tracetap.demo.wire import ChatTurn, EngineRequest, InputError, Shape

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
_BILLING_HEADER = "x-anthropic-billing-header"  # per-request hash in a system block: vLLM drops it


class MessagesRequest(EngineRequest, kw_only=True):
    """Also the ``count_tokens`` body, where ``max_tokens`` is not required."""

    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _block_text(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [b.get("text") or "" for b in content if isinstance(b, Mapping)
                and b.get("type") == "text"]
    return []


def _system(req: MessagesRequest) -> str:
    parts = _block_text(req.system)
    for m in req.messages:
        if m.get("role") == "system":
            parts += _block_text(m.get("content"))
    return "".join(p for p in parts if not p.startswith(_BILLING_HEADER))


def _tool_use(block: Mapping[str, Any]) -> dict[str, Any]:
    arguments = tok.canonical_json(block.get("input") or {})
    function = {"name": block.get("name") or "", "arguments": arguments}
    return {"id": block.get("id") or "", "type": "function", "function": function}


def _turn(i: int, role: str, blocks: list[Any]) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: tool results first, then the turn itself."""
    out, texts, calls = [], [], []
    for j, block in enumerate(blocks):
        if not isinstance(block, Mapping):
            raise InputError(f"messages[{i}].content[{j}] must be an object", "messages")
        kind = block.get("type")
        if kind == "text" and block.get("text"):
            texts.append(block["text"])
        elif kind == "image" and role == "user":  # as vLLM: the image's placeholder tokens
            texts.append(tok.IMAGE_TEXT)
        elif kind == "tool_use":
            calls.append(_tool_use(block))
        elif kind == "tool_result" and role == "user":
            result = "\n".join(_block_text(block.get("content")))
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or ""} | {
                "content": result
            })
    message: dict[str, Any] = {"role": role}
    if texts:
        message["content"] = "".join(texts)
    if calls:
        message["tool_calls"] = calls
    if role != "user" or "content" in message:
        out.append(message)
    return out


def _tool(i: int, tool: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
        raise InputError(f"tools[{i}] needs a name and an input_schema object", "tools")
    function = {"name": tool["name"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function | {"parameters": tool["input_schema"]}}


def _tool_choice(choice: Mapping[str, Any] | None) -> Any:
    kind = (choice or {}).get("type", "auto")
    if kind == "tool":
        return {"type": "function", "function": {"name": (choice or {}).get("name")}}
    return {"any": "required", "none": "none"}.get(kind, "auto")


def to_chat(req: MessagesRequest) -> ChatTurn:
    system = _system(req)
    messages = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(req.messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant", "system"):
            raise InputError(f"messages[{i}].role must be user or assistant", "messages")
        if role == "system":
            continue
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
        elif isinstance(content, list):
            messages += _turn(i, role, content)
        else:
            raise InputError(f"messages[{i}].content must be a string or a list", "messages")
    if not messages:
        raise InputError("messages must contain at least one message", "messages")
    tools = [_tool(i, t) for i, t in enumerate(req.tools or ())]
    return ChatTurn(messages, tools or None, _tool_choice(req.tool_choice))


# ---- bodies ----------------------------------------------------------------------------


def _blocks(c: Completion) -> list[dict[str, Any]]:
    blocks = [{"type": "text", "text": c.content}] if c.content else []
    for call in c.tool_calls:
        arguments = json.loads(call["function"]["arguments"])
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"]} | {
            "input": arguments
        })
    return blocks


def _usage(prompt_ids: list[int], output_tokens: int) -> dict[str, int]:
    return {"input_tokens": len(prompt_ids), "output_tokens": output_tokens}


def message_body(shape: Shape, prompt_ids: list[int], c: Completion) -> dict[str, Any]:
    """vLLM drops null fields here: ``stop_sequence`` is absent, even after a stop string."""
    body = {"id": shape.id, "type": "message", "role": "assistant", "content": _blocks(c)}
    body |= {"model": shape.model, "stop_reason": STOP_REASONS[c.finish_reason]}
    return body | {"usage": _usage(prompt_ids, len(c.token_ids))}


def message_events(shape: Shape, prompt_ids: list[int], c: Completion) -> Iterator[dict]:
    message = message_body(shape, prompt_ids, c)
    opening = message | {"content": [], "stop_reason": None, "stop_sequence": None}
    yield {"type": "message_start", "message": opening | {"usage": _usage(prompt_ids, 0)}}
    for index, block in enumerate(message["content"]):
        empty = {"text": ""} if block["type"] == "text" else {"input": {}}
        yield {"type": "content_block_start", "index": index, "content_block": block | empty}
        if block["type"] == "text":
            deltas = [{"type": "text_delta", "text": e.text}
                      for e in c.events if e.kind == "content" and e.text]
        else:
            call = index - (1 if c.content else 0)
            deltas = [{"type": "input_json_delta", "partial_json": e.text}
                      for e in c.events if e.kind == "tool_args" and e.tool_index == call]
        for delta in deltas:
            yield {"type": "content_block_delta", "index": index, "delta": delta}
        yield {"type": "content_block_stop", "index": index}
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": None}
    yield {"type": "message_delta", "delta": delta, "usage": message["usage"]}
    yield {"type": "message_stop"}
