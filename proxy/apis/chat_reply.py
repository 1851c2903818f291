"""A chat-completions reply or stream chunk, read tolerantly into what translation needs.

The upstream is not trusted to be well-formed: a missing or odd-typed field reads as
absent, never as an exception. Only the first choice counts (translation never asks
for ``n > 1``).
"""

from __future__ import annotations

from typing import Any

import msgspec


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


def read_chunk(chunk: Any) -> Chunk:
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


class _View(msgspec.Struct, kw_only=True, gc=False):
    pass


class _FunctionView(_View):
    name: str | None = None
    arguments: str | None = None


class _ToolView(_View):
    index: int | None = None
    id: str | None = None
    function: _FunctionView | None = None


class _DeltaView(_View):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[_ToolView] | None = None


class _ChoiceView(_View):
    index: int | None = None
    delta: _DeltaView | None = None
    finish_reason: str | None = None
    stop_reason: Any = None


class _LogprobsView(_View):
    content: list[dict[str, Any]] | None = None


class _ChoiceWithLogprobs(_ChoiceView):
    logprobs: _LogprobsView | None = None


class _ChunkView(_View):
    created: int | None = None
    choices: list[_ChoiceView] | None = None
    usage: dict[str, Any] | None = None
    error: Any = None


class _ChunkWithLogprobs(_ChunkView):
    choices: list[_ChoiceWithLogprobs] | None = None


_DECODE_CHUNK = msgspec.json.Decoder(_ChunkView).decode
_DECODE_CHUNK_LOGPROBS = msgspec.json.Decoder(_ChunkWithLogprobs).decode


def read_chunk_bytes(data: bytes, *, logprobs: bool = False) -> Chunk:
    """``read_chunk`` straight from the chunk's bytes: the fields translation reads are
    decoded in C (the rest, logprobs unless asked for, are skipped), which is what keeps
    a translated stream near the chat path's cost. Odd-typed fields fall back to
    ``read_chunk``'s tolerant reading; bad JSON raises msgspec.DecodeError."""
    try:
        view = (_DECODE_CHUNK_LOGPROBS if logprobs else _DECODE_CHUNK)(data)
    except msgspec.ValidationError:
        chunk = read_chunk(msgspec.json.decode(data))
        return chunk if logprobs else msgspec.structs.replace(chunk, logprobs=[])
    choice = next((c for c in view.choices or () if c.index in (None, 0)), None)
    delta = choice.delta if choice is not None and choice.delta is not None else _DeltaView()
    tools = [ToolDelta(index=position if call.index is None else call.index, id=call.id,
                       name=call.function.name if call.function is not None else None,
                       arguments=(call.function.arguments or "") if call.function else "")
             for position, call in enumerate(delta.tool_calls or ())]
    entries: list[dict[str, Any]] = []
    if logprobs and choice is not None and choice.logprobs is not None:
        entries = [e for e in choice.logprobs.content or () if isinstance(e, dict)]
    error = view.error
    return Chunk(
        text=delta.content,
        reasoning=delta.reasoning_content or delta.reasoning,
        tools=tools,
        finish_reason=choice.finish_reason if choice is not None else None,
        stop_reason=choice.stop_reason if choice is not None else None,
        logprobs=entries,
        usage=None if view.usage is None else read_usage(view.usage),
        created=view.created,
        error=_error_message(error) if error is not None and choice is None else None,
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
    # Engines name it reasoning_content (DeepSeek, SGLang, llama.cpp, older vLLM) or
    # reasoning (newer vLLM); some send both with the same text: take one, never both.
    return _str(message.get("reasoning_content")) or _str(message.get("reasoning"))


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
