"""OpenAI Responses API ⇄ chat completions, for upstreams that lack ``/v1/responses``.

``to_chat`` (in ``request.py``) turns a Responses request into a chat-completions request,
``from_chat`` here a whole chat reply into a ``response`` object, and ``StreamTranslator``
a chat stream into the Responses event stream. What is translated, dropped and rejected is listed in
docs/translation.md; anything without a faithful chat equivalent raises ``Untranslatable``.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from tracetap.proxy.apis.chat_reply import Chunk, ToolDelta, Usage, read_chunk, read_reply
from tracetap.proxy.apis.responses.request import EFFORTS, TOOL_CHOICES, to_chat, wants_logprobs
from tracetap.proxy.apis.translate_errors import Untranslatable, read_upstream_error
from tracetap.proxy.apis.wire_out import new_id, sse_event

__all__ = ["StreamTranslator", "Untranslatable", "error_from_chat", "from_chat", "to_chat",
           "untranslatable_error"]

# ---- reply -------------------------------------------------------------------------------


def from_chat(chat: dict, request: dict, *, response_id: str | None = None) -> dict:
    """A whole chat-completions reply → a Responses ``response`` object."""
    req = request if isinstance(request, dict) else {}
    reply = read_reply(chat)
    rid = response_id or new_id("resp")
    items = _Items(rid)
    output: list[dict[str, Any]] = []
    if reply.reasoning:
        output.append(_reasoning_item(items.next_id("rs"), reply.reasoning, "completed"))
    if reply.text or not reply.tool_calls:
        logprobs = _output_logprobs(reply.logprobs) if wants_logprobs(req) else []
        output.append(_message_item(items.next_id("msg"), reply.text or "", logprobs,
                                    "completed"))
    for call in reply.tool_calls:
        item_id = items.next_id("fc")
        output.append(_call_item(item_id, call.id or _call_id(item_id), call.name or "",
                                 call.arguments, "completed"))
    status, incomplete = _status(reply.finish_reason)
    if incomplete is not None:
        output[-1]["status"] = "incomplete"
    created = reply.created if reply.created is not None else int(time.time())
    return _response(req, rid, created, output, status, incomplete, reply.usage)


class _Items:
    """Output item ids: derived from the response id, so one reply always reads the same."""

    def __init__(self, response_id: str):
        self._stem = response_id.removeprefix("resp_")
        self._count = 0

    def next_id(self, prefix: str) -> str:
        item_id = f"{prefix}_{self._stem}_{self._count}"
        self._count += 1
        return item_id


def _call_id(item_id: str) -> str:
    return "call_" + item_id.removeprefix("fc_")


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _message_item(item_id: str, text: str, logprobs: list[dict[str, Any]],
                  status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text, logprobs)]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str,
               status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _output_logprobs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for entry in entries:
        token, logprob = entry.get("token"), entry.get("logprob")
        if not isinstance(token, str) or not _is_number(logprob):
            continue
        tops = [{"token": t["token"], "logprob": t["logprob"], "bytes": _bytes(t)}
                for t in entry.get("top_logprobs") or ()
                if isinstance(t, dict) and isinstance(t.get("token"), str)
                and _is_number(t.get("logprob"))]
        out.append({"token": token, "logprob": logprob, "bytes": _bytes(entry),
                    "top_logprobs": tops})
    return out


def _delta_logprobs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                              for t in e["top_logprobs"]]}
            for e in entries]


def _bytes(entry: dict[str, Any]) -> list[int]:
    raw = entry.get("bytes")
    if isinstance(raw, list) and all(isinstance(b, int) for b in raw):
        return raw
    return list(entry["token"].encode())


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _status(finish_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def _usage(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt,
        "input_tokens_details": {"cached_tokens": usage.cached or 0, "cache_write_tokens": 0},
        "output_tokens": usage.completion,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning or 0},
        "total_tokens": usage.total,
    }


def _response(req: dict[str, Any], rid: str, created: int, output: list[dict[str, Any]],
              status: str, incomplete: dict[str, Any] | None,
              usage: Usage | None) -> dict[str, Any]:
    """The response object; request settings echoed as the Responses API does."""
    metadata = req.get("metadata")
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": _echo(req, "instructions", str),
        "max_output_tokens": _echo(req, "max_output_tokens", int),
        "max_tool_calls": None,
        "metadata": metadata if isinstance(metadata, dict) else {},
        "model": _echo(req, "model", str) or "",
        "output": output,
        "parallel_tool_calls": _echo(req, "parallel_tool_calls", bool) is not False,
        "previous_response_id": None,
        "reasoning": _echo_reasoning(req.get("reasoning")),
        "temperature": _echo(req, "temperature", (int, float)),
        "text": req["text"] if isinstance(req.get("text"), dict) else {"format": {"type": "text"}},
        "tool_choice": _echo_tool_choice(req.get("tool_choice")),
        "tools": _echo_tools(req.get("tools")),
        "top_p": _echo(req, "top_p", (int, float)),
        "truncation": "disabled",
        "usage": _usage(usage),
        "user": _echo(req, "user", str),
    }


def _echo(req: dict[str, Any], key: str, kind: Any) -> Any:
    value = req.get(key)
    if isinstance(value, bool) and kind is not bool:
        return None
    return value if isinstance(value, kind) else None


def _echo_reasoning(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        return None
    effort, summary = value.get("effort"), value.get("summary")
    return {"effort": effort if effort in (*EFFORTS, "minimal", "none") else None,
            "summary": summary if summary in ("auto", "concise", "detailed") else None}


def _echo_tool_choice(value: Any) -> Any:
    if value in TOOL_CHOICES:
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(
            value.get("name"), str):
        return {"type": "function", "name": value["name"]}
    return "auto"


def _echo_tools(value: Any) -> list[dict[str, Any]]:
    tools = []
    for tool in value if isinstance(value, list) else ():
        if isinstance(tool, dict) and tool.get("type") == "function" and isinstance(
                tool.get("name"), str):
            tools.append({"type": "function", "name": tool["name"],
                          "description": tool.get("description"),
                          "parameters": tool.get("parameters"), "strict": tool.get("strict")})
    return tools


# ---- stream ------------------------------------------------------------------------------


class _Open(msgspec.Struct, kw_only=True):
    """The output item currently receiving deltas."""

    kind: str  # reasoning | message | function_call
    index: int  # output_index
    item_id: str
    text: list[str] = []
    logprobs: list[dict[str, Any]] = []
    tool: int | None = None  # the chat tool-call index


class _Tool(msgspec.Struct, kw_only=True):
    id: str | None
    name: str | None
    arguments: list[str]
    index: int | None = None  # output_index, once its item is added


class StreamTranslator:
    """A chat-completions stream → the Responses event stream, chunk by chunk.

    Items follow the chat stream's order (reasoning, text, tool calls); a change of kind
    closes the open item. Each event carries a ``sequence_number``.
    """

    def __init__(self, request: dict, *, response_id: str | None = None):
        self._req = request if isinstance(request, dict) else {}
        self._id = response_id or new_id("resp")
        self._ids = _Items(self._id)
        self._logprobs = self.wants_logprobs = wants_logprobs(self._req)
        self._seq = 0
        self._created: int | None = None
        self._output: list[dict[str, Any]] = []  # every item added so far, final when closed
        self._open: _Open | None = None
        self._tools: dict[int, _Tool] = {}
        self._finish: str | None = None
        self._usage: Usage | None = None
        self._closed = False

    def feed(self, chunk: dict | Chunk) -> list[bytes]:
        """One decoded chat stream chunk → zero or more Responses SSE events."""
        if self._closed:
            return []
        parsed = chunk if isinstance(chunk, Chunk) else read_chunk(chunk)
        if parsed.error is not None:
            return [self.error_event(parsed.error)]
        out = self._start(parsed.created)
        if parsed.usage is not None:
            self._usage = parsed.usage
        if parsed.reasoning:
            out += self._reasoning(parsed.reasoning)
        if parsed.text or (parsed.text is not None and parsed.logprobs and self._logprobs):
            out += self._text(parsed.text, parsed.logprobs)
        for delta in parsed.tools:
            out += self._tool_delta(delta)
        if parsed.finish_reason is not None:
            self._finish = parsed.finish_reason
        return out

    def finish(self) -> list[bytes]:
        """The chat stream ended ([DONE]): close the open item and complete the response."""
        if self._closed:
            return []
        out = self._start(None)
        status, incomplete = _status(self._finish)
        last = "incomplete" if incomplete is not None else "completed"
        if not any(item["type"] in ("message", "function_call") for item in self._output):
            out += self._close("completed")
            out += self._open_message()
        out += self._close(last)
        self._closed = True
        response = self._response(status, incomplete)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*out, self._event(kind, {"response": response})]

    def error_event(self, message: str) -> bytes:
        """The stream broke: an ``error`` event and ``response.failed``; nothing after."""
        if self._closed:
            return b""
        out = self._start(None)
        self._closed = True
        error = {"message": message, "code": "server_error", "param": None}
        out.append(self._event("error", error))
        response = self._response("failed", None)
        response["error"] = {"code": "server_error", "message": message}
        response["output"] = [item for item in response["output"]
                              if item.get("status") != "in_progress"]
        out.append(self._event("response.failed", {"response": response}))
        return b"".join(out)

    # -- events

    def _event(self, name: str, payload: dict[str, Any]) -> bytes:
        data = {"type": name, "sequence_number": self._seq, **payload}
        self._seq += 1
        return sse_event(name, data)

    def _response(self, status: str, incomplete: dict[str, Any] | None) -> dict[str, Any]:
        created = self._created if self._created is not None else int(time.time())
        return _response(self._req, self._id, created, list(self._output), status, incomplete,
                         self._usage)

    def _start(self, created: int | None) -> list[bytes]:
        if self._created is not None:
            return []
        self._created = created if created is not None else int(time.time())
        response = self._response("in_progress", None)
        response["usage"] = None
        return [self._event("response.created", {"response": response}),
                self._event("response.in_progress", {"response": response})]

    def _add(self, kind: str, item: dict[str, Any], tool: int | None = None) -> list[bytes]:
        index = len(self._output)
        self._output.append(item)
        self._open = _Open(kind=kind, index=index, item_id=item["id"], tool=tool)
        return [self._event("response.output_item.added", {"output_index": index, "item": item})]

    def _part(self, name: str, opened: _Open, part: dict[str, Any]) -> bytes:
        return self._event(name, {"item_id": opened.item_id, "output_index": opened.index,
                                  "content_index": 0, "part": part})

    def _reasoning(self, text: str) -> list[bytes]:
        out = []
        opened = self._open
        if opened is None or opened.kind != "reasoning":
            out += self._close("completed")
            out += self._add("reasoning", {"id": self._ids.next_id("rs"), "type": "reasoning",
                                           "summary": [], "content": [], "status": "in_progress"})
            opened = self._open
            out.append(self._part("response.content_part.added", opened,
                                  {"type": "reasoning_text", "text": ""}))
        opened.text.append(text)
        out.append(self._event("response.reasoning_text.delta", {
            "item_id": opened.item_id, "output_index": opened.index, "content_index": 0,
            "delta": text}))
        return out

    def _open_message(self) -> list[bytes]:
        out = self._add("message", {"id": self._ids.next_id("msg"), "type": "message",
                                    "role": "assistant", "status": "in_progress", "content": []})
        return [*out, self._part("response.content_part.added", self._open, _text_part("", []))]

    def _text(self, text: str, entries: list[dict[str, Any]]) -> list[bytes]:
        out = []
        if self._open is None or self._open.kind != "message":
            out += self._close("completed")
            out += self._open_message()
        opened = self._open
        assert opened is not None
        logprobs = _output_logprobs(entries) if self._logprobs else []
        opened.text.append(text)
        opened.logprobs.extend(logprobs)
        out.append(self._event("response.output_text.delta", {
            "item_id": opened.item_id, "output_index": opened.index, "content_index": 0,
            "delta": text, "logprobs": _delta_logprobs(logprobs)}))
        return out

    def _tool_delta(self, delta: ToolDelta) -> list[bytes]:
        out = []
        tool = self._tools.get(delta.index)
        if tool is None:
            out += self._close("completed")
            tool = self._tools[delta.index] = _Tool(id=delta.id, name=delta.name, arguments=[])
            self._open = _Open(kind="function_call", index=-1, item_id="", tool=delta.index)
        elif tool.index is None:
            tool.id, tool.name = tool.id or delta.id, tool.name or delta.name
        if tool.index is None:
            tool.arguments.append(delta.arguments)
            if tool.name is not None:  # engines send id and name first; wait for the name
                out += self._add_call(delta.index)
        elif delta.arguments:
            item = self._output[tool.index]
            item["arguments"] += delta.arguments  # a late delta still reaches the final item
            out.append(self._event("response.function_call_arguments.delta", {
                "item_id": item["id"], "output_index": tool.index, "delta": delta.arguments}))
        return out

    def _add_call(self, chat_index: int) -> list[bytes]:
        tool = self._tools[chat_index]
        item_id = self._ids.next_id("fc")
        out = self._add("function_call", {
            "id": item_id, "type": "function_call", "call_id": tool.id or _call_id(item_id),
            "name": tool.name or "", "arguments": "", "status": "in_progress"}, chat_index)
        tool.index = len(self._output) - 1
        buffered = "".join(tool.arguments)
        if buffered:
            self._output[tool.index]["arguments"] = buffered
            out.append(self._event("response.function_call_arguments.delta", {
                "item_id": item_id, "output_index": tool.index, "delta": buffered}))
        return out

    def _close(self, status: str) -> list[bytes]:
        opened, self._open = self._open, None
        if opened is None:
            return []
        if opened.index < 0:  # a tool call whose name never came: add it now
            return [*self._add_call(opened.tool), *self._close(status)]  # type: ignore[arg-type]
        item = self._output[opened.index]
        where = {"item_id": opened.item_id, "output_index": opened.index}
        out = []
        if opened.kind == "reasoning":
            text = "".join(opened.text)
            out.append(self._event("response.reasoning_text.done",
                                   {**where, "content_index": 0, "text": text}))
            out.append(self._part("response.content_part.done", opened,
                                  {"type": "reasoning_text", "text": text}))
            item.update(_reasoning_item(item["id"], text, status))
        elif opened.kind == "message":
            text = "".join(opened.text)
            out.append(self._event("response.output_text.done", {
                **where, "content_index": 0, "text": text,
                "logprobs": _delta_logprobs(opened.logprobs)}))
            part = _text_part(text, opened.logprobs)
            out.append(self._part("response.content_part.done", opened, part))
            item.update(_message_item(item["id"], text, opened.logprobs, status))
        else:
            out.append(self._event("response.function_call_arguments.done", {
                **where, "arguments": item["arguments"], "name": item["name"]}))
            item["status"] = status
        out.append(self._event("response.output_item.done",
                               {"output_index": opened.index, "item": dict(item)}))
        return out


# ---- errors ------------------------------------------------------------------------------


def error_from_chat(status: int, body: bytes) -> bytes:
    """An upstream chat error body (any shape) → an OpenAI error body; never raises."""
    error = read_upstream_error(status, body)
    kind = error.type or ("server_error" if status >= 500 else "invalid_request_error")
    return msgspec.json.encode({"error": {"message": error.message, "type": kind,
                                          "param": error.param, "code": error.code}})


def untranslatable_error(exc: Untranslatable) -> bytes:
    """The 400 body for a request that cannot be translated."""
    return msgspec.json.encode({"error": {
        "message": f"cannot translate this Responses request to chat completions: "
                   f"{exc.message}",
        "type": "invalid_request_error", "param": exc.param, "code": "unsupported_parameter"}})

