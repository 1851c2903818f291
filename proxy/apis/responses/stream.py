"""A chat-completions stream → the Responses event stream (``StreamTranslator``)."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from tracetap.proxy.apis.chat.reply import Chunk, ToolDelta, Usage, read_chunk
from tracetap.proxy.apis.responses.objects import (
    Items,
    call_id,
    delta_logprobs,
    message_item,
    output_logprobs,
    reasoning_item,
    response_object,
    status_of,
    text_part,
)
from tracetap.proxy.apis.responses.request import wants_logprobs
from tracetap.proxy.apis.wire_out import new_id, sse_event


class _Open(msgspec.Struct, kw_only=True):
    """The output item currently receiving deltas."""

    kind: str  # reasoning | message | function_call
    index: int  # output_index
    item_id: str
    text: list[str] = []
    logprobs: list[dict[str, Any]] = []
    tool: int | None = None  # the chat tool-call index, while its name has not come


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
        self._ids = Items(self._id)
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
        status, incomplete = status_of(self._finish)
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
        return response_object(self._req, self._id, created, list(self._output), status,
                               incomplete, self._usage)

    def _start(self, created: int | None) -> list[bytes]:
        if self._created is not None:
            return []
        self._created = created if created is not None else int(time.time())
        response = self._response("in_progress", None)  # usage null: a chunk's is read after
        return [self._event("response.created", {"response": response}),
                self._event("response.in_progress", {"response": response})]

    def _add(self, kind: str, item: dict[str, Any]) -> list[bytes]:
        index = len(self._output)
        self._output.append(item)
        self._open = _Open(kind=kind, index=index, item_id=item["id"])
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
        return [*out, self._part("response.content_part.added", self._open, text_part("", []))]

    def _text(self, text: str, entries: list[dict[str, Any]]) -> list[bytes]:
        out = []
        if self._open is None or self._open.kind != "message":
            out += self._close("completed")
            out += self._open_message()
        opened = self._open
        assert opened is not None
        logprobs = output_logprobs(entries) if self._logprobs else []
        opened.text.append(text)
        opened.logprobs.extend(logprobs)
        out.append(self._event("response.output_text.delta", {
            "item_id": opened.item_id, "output_index": opened.index, "content_index": 0,
            "delta": text, "logprobs": delta_logprobs(logprobs)}))
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
            "id": item_id, "type": "function_call", "call_id": tool.id or call_id(item_id),
            "name": tool.name or "", "arguments": "", "status": "in_progress"})
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
            item.update(reasoning_item(item["id"], text, status))
        elif opened.kind == "message":
            text = "".join(opened.text)
            out.append(self._event("response.output_text.done", {
                **where, "content_index": 0, "text": text,
                "logprobs": delta_logprobs(opened.logprobs)}))
            part = text_part(text, opened.logprobs)
            out.append(self._part("response.content_part.done", opened, part))
            item.update(message_item(item["id"], text, opened.logprobs, status))
        else:
            out.append(self._event("response.function_call_arguments.done", {
                **where, "arguments": item["arguments"], "name": item["name"]}))
            item["status"] = status
        out.append(self._event("response.output_item.done",
                               {"output_index": opened.index, "item": dict(item)}))
        return out
