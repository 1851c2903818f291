"""Anthropic Messages API ⇄ chat completions, for upstreams that lack ``/v1/messages``
or cannot give token ids and logprobs for it.

``to_chat`` (in ``request.py``) turns a Messages request into a chat-completions request,
``from_chat`` here a whole chat reply into a ``message`` object, and ``StreamTranslator``
a chat stream into the Messages event stream. What is translated, dropped and rejected is listed in
docs/translation.md; anything without a faithful chat equivalent raises ``Untranslatable``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tracetap.proxy.apis.chat.reply import Chunk, ToolDelta, Usage, read_chunk, read_reply
from tracetap.proxy.apis.messages.errors import ANTHROPIC_ERRORS
from tracetap.proxy.apis.messages.request import to_chat
from tracetap.proxy.apis.translate_errors import Untranslatable
from tracetap.proxy.apis.wire_out import new_id, sse_event
from tracetap.proxy.http.errors import ProxyError

__all__ = ["ERRORS", "StreamTranslator", "Untranslatable", "error_from_chat", "from_chat",
           "to_chat", "untranslatable"]

ERRORS = ANTHROPIC_ERRORS  # the client's error shape

_FINISH = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
           "function_call": "tool_use", "content_filter": "refusal"}


# ---- reply -------------------------------------------------------------------------------


def from_chat(chat: dict, request: dict, *, response_id: str | None = None) -> dict:
    """A whole chat-completions reply → a Messages ``message`` object."""
    req = request if isinstance(request, dict) else {}
    reply = read_reply(chat)
    message_id = response_id or new_id("msg")
    content: list[dict[str, Any]] = []
    if reply.reasoning:
        content.append(_thinking_block(reply.reasoning))
    if reply.text:
        content.append({"type": "text", "text": reply.text})
    for n, call in enumerate(reply.tool_calls):
        content.append({"type": "tool_use", "id": call.id or _tool_use_id(message_id, n),
                        "name": call.name or "", "input": _input(call.arguments)})
    stop_reason, stop_sequence = _stop(reply.finish_reason, reply.stop_reason,
                                       bool(reply.tool_calls), req)
    message = _message(req, message_id, content, _usage(reply.usage))
    message["stop_reason"], message["stop_sequence"] = stop_reason, stop_sequence
    return message


def _message(req: dict[str, Any], message_id: str, content: list[dict[str, Any]],
             usage: dict[str, Any]) -> dict[str, Any]:
    model = req.get("model")
    return {"id": message_id, "type": "message", "role": "assistant",
            "model": model if isinstance(model, str) else "", "content": content,
            "stop_reason": None, "stop_sequence": None, "usage": usage}


def _thinking_block(text: str) -> dict[str, Any]:
    # No signature: the engine's reasoning is plain text; sent back, it is read as such.
    return {"type": "thinking", "thinking": text, "signature": ""}


def _tool_use_id(message_id: str, n: int) -> str:
    return f"toolu_{message_id.removeprefix('msg_')}_{n}"


def _input(arguments: str) -> dict[str, Any]:
    """Tool-call arguments as the input object; text that is not a JSON object reads as
    ``{}`` (the stored chat call keeps the model's exact text)."""
    try:
        value = msgspec.json.decode(arguments) if arguments.strip() else {}
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop(finish: str | None, matched: Any, tool_calls: bool,
          req: dict[str, Any]) -> tuple[str, str | None]:
    stops = req.get("stop_sequences")
    if finish == "stop" and isinstance(matched, str) and isinstance(stops, list) and (
            matched in stops):
        return "stop_sequence", matched
    if tool_calls and finish != "length":
        return "tool_use", None
    return _FINISH.get(finish or "stop", "end_turn"), None


def _usage(usage: Usage | None) -> dict[str, Any]:
    """Anthropic counts cache reads apart from input_tokens; chat includes them."""
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    out = {"input_tokens": usage.prompt - (usage.cached or 0), "output_tokens": usage.completion}
    if usage.cached is not None:
        out["cache_read_input_tokens"] = usage.cached
    return out


# ---- stream ------------------------------------------------------------------------------


class _Block(msgspec.Struct, kw_only=True):
    kind: str  # thinking | text | tool_use
    index: int  # content block index; -1 for a tool call not yet started (no name yet)
    tool: int | None = None  # the chat tool-call index


class _Tool(msgspec.Struct, kw_only=True):
    id: str | None
    name: str | None
    arguments: list[str]
    index: int | None = None  # content block index, once started


class StreamTranslator:
    """A chat-completions stream → the Messages event stream, chunk by chunk.

    Blocks follow the chat stream's order (thinking, text, tool calls); a change of kind
    stops the open block.
    """

    def __init__(self, request: dict, *, response_id: str | None = None):
        self.wants_logprobs = False  # Messages has no logprobs to give back
        self._req = request if isinstance(request, dict) else {}
        self._id = response_id or new_id("msg")
        self._started = False
        self._closed = False
        self._blocks = 0
        self._open: _Block | None = None
        self._tools: dict[int, _Tool] = {}
        self._finish: str | None = None
        self._matched: Any = None
        self._usage: Usage | None = None

    def feed(self, chunk: dict | Chunk) -> list[bytes]:
        """One decoded chat stream chunk → zero or more Messages SSE events."""
        if self._closed:
            return []
        parsed = chunk if isinstance(chunk, Chunk) else read_chunk(chunk)
        if parsed.error is not None:
            return [self.error_event(parsed.error)]
        if parsed.usage is not None:
            self._usage = parsed.usage
        out = self._start()
        if parsed.reasoning:
            out += self._delta("thinking", {"type": "thinking_delta",
                                            "thinking": parsed.reasoning})
        if parsed.text:
            out += self._delta("text", {"type": "text_delta", "text": parsed.text})
        for delta in parsed.tools:
            out += self._tool_delta(delta)
        if parsed.finish_reason is not None:
            self._finish, self._matched = parsed.finish_reason, parsed.stop_reason
        return out

    def finish(self) -> list[bytes]:
        """The chat stream ended ([DONE]): stop the open block, then message_delta and
        message_stop."""
        if self._closed:
            return []
        out = self._start()
        out += self._stop_block()
        self._closed = True
        stop_reason, stop_sequence = _stop(self._finish, self._matched, bool(self._tools),
                                           self._req)
        usage = _usage(self._usage)
        out.append(sse_event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": usage}))
        out.append(sse_event("message_stop", {"type": "message_stop"}))
        return out

    def error_event(self, message: str) -> bytes:
        """The stream broke: an ``error`` event; nothing is sent after it."""
        if self._closed:
            return b""
        self._closed = True
        return sse_event("error", {"type": "error",
                                   "error": {"type": "api_error", "message": message}})

    # -- events

    def _start(self) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        # input_tokens is known only when the upstream reports usage (at the end, in
        # message_delta, unless a chunk already carried it).
        usage = {"input_tokens": self._usage.prompt - (self._usage.cached or 0)
                 if self._usage is not None else 0, "output_tokens": 0}
        message = _message(self._req, self._id, [], usage)
        return [sse_event("message_start", {"type": "message_start", "message": message})]

    def _begin(self, kind: str, block: dict[str, Any], tool: int | None = None) -> bytes:
        self._open = _Block(kind=kind, index=self._blocks, tool=tool)
        self._blocks += 1
        return sse_event("content_block_start", {"type": "content_block_start",
                                                 "index": self._open.index,
                                                 "content_block": block})

    def _delta(self, kind: str, delta: dict[str, Any]) -> list[bytes]:
        out = []
        if self._open is None or self._open.kind != kind:
            out += self._stop_block()
            start = _thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
            out.append(self._begin(kind, start))
        out.append(self._block_delta(self._open.index, delta))  # type: ignore[union-attr]
        return out

    @staticmethod
    def _block_delta(index: int, delta: dict[str, Any]) -> bytes:
        return sse_event("content_block_delta",
                         {"type": "content_block_delta", "index": index, "delta": delta})

    def _tool_delta(self, delta: ToolDelta) -> list[bytes]:
        out = []
        tool = self._tools.get(delta.index)
        if tool is None:
            out += self._stop_block()
            tool = self._tools[delta.index] = _Tool(id=delta.id, name=delta.name, arguments=[])
            self._open = _Block(kind="tool_use", index=-1, tool=delta.index)
        elif tool.index is None:
            tool.id, tool.name = tool.id or delta.id, tool.name or delta.name
        if tool.index is None:
            tool.arguments.append(delta.arguments)
            if tool.name is not None:  # engines send id and name first; wait for the name
                out += self._start_tool(delta.index)
        elif delta.arguments:
            # A late delta for an earlier call still goes to its block index.
            out.append(self._block_delta(tool.index, {"type": "input_json_delta",
                                                      "partial_json": delta.arguments}))
        return out

    def _start_tool(self, chat_index: int) -> list[bytes]:
        tool = self._tools[chat_index]
        tool.index = self._blocks
        block = {"type": "tool_use", "id": tool.id or _tool_use_id(self._id, chat_index),
                 "name": tool.name or "", "input": {}}
        out = [self._begin("tool_use", block, chat_index)]
        buffered = "".join(tool.arguments)
        if buffered:
            out.append(self._block_delta(tool.index, {"type": "input_json_delta",
                                                      "partial_json": buffered}))
        return out

    def _stop_block(self) -> list[bytes]:
        opened, self._open = self._open, None
        if opened is None:
            return []
        if opened.index < 0:  # a tool call whose name never came: start it now
            return [*self._start_tool(opened.tool), *self._stop_block()]  # type: ignore[arg-type]
        return [sse_event("content_block_stop",
                          {"type": "content_block_stop", "index": opened.index})]


# ---- errors ------------------------------------------------------------------------------


def error_from_chat(status: int, body: bytes) -> bytes:
    """An upstream chat error body (any shape) → an Anthropic error body; never raises."""
    return ERRORS.from_upstream(status, body)


def untranslatable(exc: Untranslatable) -> ProxyError:
    """The 400 for a request that cannot be translated (its body: ``ERRORS.body``)."""
    return exc.refusal("Messages")
