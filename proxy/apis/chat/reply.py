"""A chat-completions reply or stream chunk, read tolerantly into what translation needs.

The chat wire shape is decoded by ``wire``'s Structs (the one set capture and
overlays read too). The upstream is not trusted to be well-formed: a reply or chunk with
an odd-typed field is read again field by field, where such a field reads as absent,
never as an exception. Only the first choice counts (translation never asks for
``n > 1``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from tracetap.proxy.apis.chat import wire


class Usage(msgspec.Struct, kw_only=True, frozen=True):
    prompt: int
    completion: int
    total: int
    cached: int | None = None  # prompt_tokens_details.cached_tokens
    reasoning: int | None = None  # completion_tokens_details.reasoning_tokens


class ToolCall(msgspec.Struct, kw_only=True, frozen=True):
    id: str | None
    name: str | None
    arguments: str


class ToolDelta(msgspec.Struct, kw_only=True, frozen=True):
    index: int
    id: str | None
    name: str | None
    arguments: str


class Reply(msgspec.Struct, kw_only=True, frozen=True):
    """A whole (non-streamed) chat completion."""

    text: str | None
    reasoning: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None
    stop_reason: Any  # vLLM/SGLang: the stop string (or token id) that ended the text
    logprobs: list[dict[str, Any]]  # chat ``logprobs.content`` entries
    usage: Usage | None
    created: int | None


class Chunk(msgspec.Struct, kw_only=True, frozen=True):
    """One chat stream chunk."""

    text: str | None
    reasoning: str | None
    tools: list[ToolDelta]
    finish_reason: str | None
    stop_reason: Any
    logprobs: list[dict[str, Any]]
    usage: Usage | None
    created: int | None
    error: str | None  # an error object sent in place of a chunk


def read_reply(chat: Any) -> Reply:
    """A whole chat reply (decoded JSON) → a ``Reply``."""
    try:
        body = wire.as_chat_entries(chat)
    except msgspec.ValidationError:
        return _tolerant_reply(chat)
    choice = wire.first_choice(body.choices)
    message = (choice.message if choice is not None else None) or wire.Message()
    return Reply(
        text=message.content,
        reasoning=message.reasoning_text,
        tool_calls=[ToolCall(id=c.id, name=_name(c), arguments=_arguments(c))
                    for c in message.tool_calls or ()],
        finish_reason=choice.finish_reason if choice is not None else None,
        stop_reason=choice.stop_reason if choice is not None else None,
        logprobs=_entries(choice),
        usage=_usage(body.usage),
        created=body.created,
    )


def read_chunk(chunk: Any) -> Chunk:
    """One chat stream chunk (decoded JSON) → a ``Chunk``."""
    try:
        body = wire.as_chat_entries(chunk)
    except msgspec.ValidationError:
        return _tolerant_chunk(chunk)
    if body.error is not None:  # rare: read as tolerantly as ever
        return _tolerant_chunk(chunk)
    return _chunk(body, logprobs=True)


def read_chunk_bytes(data: bytes, *, logprobs: bool = False) -> Chunk:
    """``read_chunk`` straight from the chunk's bytes: the fields translation reads are
    decoded in C (the rest, logprobs unless asked for, are skipped), which is what keeps
    a translated stream near the chat path's cost. Odd-typed fields fall back to the
    tolerant reading; bad JSON raises msgspec.DecodeError."""
    try:
        body = (wire.decode_chat_entries if logprobs else wire.decode_chat_text)(data)
    except msgspec.ValidationError:
        body = None
    if body is None or body.error is not None:  # rare: read as tolerantly as ever
        chunk = _tolerant_chunk(msgspec.json.decode(data))
        return chunk if logprobs else msgspec.structs.replace(chunk, logprobs=[])
    return _chunk(body, logprobs=logprobs)


def _chunk(body: wire.ChatTextBody, *, logprobs: bool) -> Chunk:
    choice = wire.first_choice(body.choices)
    delta = (choice.delta if choice is not None else None) or wire.Message()
    return Chunk(
        text=delta.content,
        reasoning=delta.reasoning_text,
        tools=[ToolDelta(index=position if c.index is None else c.index, id=c.id,
                         name=_name(c), arguments=_arguments(c))
               for position, c in enumerate(delta.tool_calls or ())],
        finish_reason=choice.finish_reason if choice is not None else None,
        stop_reason=choice.stop_reason if choice is not None else None,
        logprobs=_entries(choice) if logprobs else [],
        usage=_usage(body.usage),
        created=body.created,
        error=None,  # a chunk with an error object is read field by field
    )


def _name(call: wire.ToolCall) -> str | None:
    return call.function.name if call.function is not None else None


def _arguments(call: wire.ToolCall) -> str:
    return (call.function.arguments or "") if call.function is not None else ""


def _entries(choice: wire.ChatTextChoice | None) -> list[dict[str, Any]]:
    logprobs = getattr(choice, "logprobs", None)
    if logprobs is None:
        return []
    return [e for e in logprobs.content or () if isinstance(e, dict)]


def _usage(usage: wire.Usage | None) -> Usage | None:
    if usage is None or (usage.prompt_tokens is None and usage.completion_tokens is None):
        return None
    prompt, completion = usage.prompt_tokens or 0, usage.completion_tokens or 0
    details, output = usage.prompt_tokens_details, usage.completion_tokens_details
    return Usage(
        prompt=prompt,
        completion=completion,
        total=prompt + completion if usage.total_tokens is None else usage.total_tokens,
        cached=details.cached_tokens if details is not None else None,
        reasoning=output.reasoning_tokens if output is not None else None,
    )


# ---- field by field, for replies and chunks with odd-typed fields --------------------------


def _tolerant_reply(chat: Any) -> Reply:
    body = chat if isinstance(chat, dict) else {}
    choice = _first_choice(body)
    message = _dict(choice.get("message"))
    calls = []
    for call in _list(message.get("tool_calls")):
        call = _dict(call)
        function = _dict(call.get("function"))
        arguments = function.get("arguments")
        calls.append(ToolCall(
            id=_str(call.get("id")),
            name=_str(function.get("name")),
            arguments=arguments if isinstance(arguments, str) else _json_text(arguments),
        ))
    return Reply(
        text=_str(message.get("content")),
        reasoning=_reasoning(message),
        tool_calls=calls,
        finish_reason=_str(choice.get("finish_reason")),
        stop_reason=choice.get("stop_reason"),
        logprobs=_logprobs(choice),
        usage=read_usage(body.get("usage")),
        created=_int(body.get("created")),
    )


def _tolerant_chunk(chunk: Any) -> Chunk:
    body = chunk if isinstance(chunk, dict) else {}
    choice = _first_choice(body)
    delta = _dict(choice.get("delta"))
    tools = []
    for position, call in enumerate(_list(delta.get("tool_calls"))):
        call = _dict(call)
        function = _dict(call.get("function"))
        index = _int(call.get("index"))
        tools.append(ToolDelta(
            index=position if index is None else index,
            id=_str(call.get("id")),
            name=_str(function.get("name")),
            arguments=_str(function.get("arguments")) or "",
        ))
    error = body.get("error")
    return Chunk(
        text=_str(delta.get("content")),
        reasoning=_reasoning(delta),
        tools=tools,
        finish_reason=_str(choice.get("finish_reason")),
        stop_reason=choice.get("stop_reason"),
        logprobs=_logprobs(choice),
        usage=read_usage(body.get("usage")),
        created=_int(body.get("created")),
        error=_error_message(error) if error is not None and not choice else None,
    )


def read_usage(value: Any) -> Usage | None:
    usage = _dict(value)
    prompt, completion = _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens"))
    if prompt is None and completion is None:
        return None
    prompt, completion = prompt or 0, completion or 0
    total = _int(usage.get("total_tokens"))
    return Usage(
        prompt=prompt,
        completion=completion,
        total=prompt + completion if total is None else total,
        cached=_int(_dict(usage.get("prompt_tokens_details")).get("cached_tokens")),
        reasoning=_int(_dict(usage.get("completion_tokens_details")).get("reasoning_tokens")),
    )


def _first_choice(body: dict[str, Any]) -> dict[str, Any]:
    for choice in _list(body.get("choices")):
        choice = _dict(choice)
        if _int(choice.get("index")) in (None, 0):
            return choice
    return {}


def _reasoning(message: dict[str, Any]) -> str | None:
    # The one rule for which field carries it lives with the wire Structs.
    return wire.Message(reasoning_content=_str(message.get("reasoning_content")),
                        reasoning=_str(message.get("reasoning"))).reasoning_text


def _logprobs(choice: dict[str, Any]) -> list[dict[str, Any]]:
    content = _dict(choice.get("logprobs")).get("content")
    return [entry for entry in _list(content) if isinstance(entry, dict)]


def _error_message(error: Any) -> str:
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    return error if isinstance(error, str) else _json_text(error)


def _json_text(value: Any) -> str:
    if value is None:
        return ""
    try:
        return msgspec.json.encode(value).decode()
    except (TypeError, msgspec.EncodeError):
        return str(value)


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
