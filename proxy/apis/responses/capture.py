"""The OpenAI Responses API, captured natively (vLLM serves it with logprobs and ids).

Logprobs are asked for with ``include: ["message.output_text.logprobs"]``; token ids
with vLLM's ``enable_response_messages`` (prompt and output ids in ``input_messages`` /
``output_messages``, in streams only in the final event). Both are taken out again
before the client sees a byte. The stream has no ``[DONE]``: ``response.completed``
(or ``.incomplete`` / ``.failed``) ends it, and is journaled before it is relayed.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tracetap.proxy.apis import CaptureBase, Injected
from tracetap.proxy.apis.chat.inject import count_field
from tracetap.proxy.apis.chat.wire import decode_event, decode_object, encode
from tracetap.proxy.http.sse import Event
from tracetap.storage.records import ChoiceRecord

LOGPROBS_INCLUDE = "message.output_text.logprobs"
TERMINAL = ("response.completed", "response.incomplete", "response.failed")
_ID_FLAVORS = ("vllm",)


class ResponsesApi:
    endpoint = "responses"
    route = "responses"
    path = "/v1/responses"
    ends_with_done = False  # the end is an event with data, not [DONE]
    speaks_chat = continuable = cuts_prompt_ids = routed_experts = prompt_in_request = False

    def prepare(self, payload: dict[str, Any], flavor: str) -> Injected:
        injected = Injected()
        include = payload.get("include")
        include = include if isinstance(include, list) else []
        top = count_field(payload, "top_logprobs")
        if LOGPROBS_INCLUDE in include:
            injected.client_top_logprobs = top
        else:
            payload["include"] = [*include, LOGPROBS_INCLUDE]
            injected.logprobs = True
            injected.top_logprobs_echo = "top_logprobs" not in payload
        if flavor in _ID_FLAVORS and not payload.get("enable_response_messages"):
            payload["enable_response_messages"] = True
            injected.token_ids = True
        return injected

    def strip_body(self, body: bytes, injected: Injected) -> bytes:
        return encode(_strip_response(decode_object(body), injected))

    def strip_event(self, event: Event, injected: Injected) -> bytes:
        """Only events that carry what the proxy asked for are re-encoded; every other
        event (unknown types included) goes out byte for byte."""
        assert event.data is not None
        data = decode_object(event.data)
        changed = False
        if isinstance(data.get("response"), dict):
            _strip_response(data["response"], injected)
            changed = True
        if injected.logprobs:
            if data.get("type") == "response.output_text.delta" and data.get("logprobs"):
                data["logprobs"] = []
                changed = True
            for key in ("part", "item"):
                if isinstance(data.get(key), dict):
                    changed = _strip_item(data[key]) or changed
        if not changed:
            return event.raw
        raw = event.raw
        head = raw[: raw.index(b"data:")] if b"data:" in raw else b""
        return head + b"data: " + encode(data) + b"\n\n"

    def is_end(self, data: bytes) -> bool:
        return False  # the terminal event carries the whole response: see ResponsesCapture

    def capture(self, injected: Injected) -> ResponsesCapture:
        return ResponsesCapture(keep_top=injected.client_top_logprobs > 0)


def _strip_response(response: dict[str, Any], injected: Injected) -> dict[str, Any]:
    if injected.token_ids:
        for key in ("input_messages", "output_messages"):
            if key in response:
                response[key] = None
    if injected.logprobs:
        if injected.top_logprobs_echo and "top_logprobs" in response:
            response["top_logprobs"] = None
        for item in response.get("output") or ():
            if isinstance(item, dict):
                _strip_item(item)
    return response


def _strip_item(item: dict[str, Any]) -> bool:
    """A message item or content part: the logprobs the proxy asked for become null.
    Returns whether anything changed."""
    changed = False
    if item.get("logprobs"):
        item["logprobs"] = None
        changed = True
    for part in item.get("content") or ():
        if isinstance(part, dict) and part.get("logprobs"):
            part["logprobs"] = None
            changed = True
    return changed


class ResponsesCapture(CaptureBase):
    """Reassembles a Responses reply: deltas as they come, the final response object
    as the authority (it holds the ids and every logprob). Without it only the text and
    its logprobs are kept: a choice record has no tool calls of its own."""

    def __init__(self, keep_top: bool = False):
        super().__init__()
        self.keep_top = keep_top
        self.final: dict[str, Any] | None = None
        self._text: list[str] = []
        self._logprobs: list[Any] = []

    def add(self, data: bytes) -> None:
        event = decode_event(data, self.errors)
        if event is None:
            return
        kind = event.get("type")
        if event.get("object") == "response":  # a whole, non-streamed reply
            self._final(event)
            return
        if isinstance(event.get("response"), dict):
            self.response_id = event["response"].get("id") or self.response_id
            self.model = event["response"].get("model") or self.model
            if kind in TERMINAL:
                self._final(event["response"])
                self.ended = True
        elif kind == "response.output_text.delta":
            self._text.append(event.get("delta") or "")
            self._logprobs.extend(event.get("logprobs") or ())
        elif kind == "error":
            if len(self.errors) < 5:
                self.errors.append(f"upstream stream error: {event.get('message')}")
        elif not (isinstance(kind, str) and kind.startswith("response.")):
            self.unknown_events += 1  # relayed as it came; counted

    def _final(self, response: dict[str, Any]) -> None:
        self.final = response
        self.response_id = response.get("id") or self.response_id
        self.model = response.get("model") or self.model
        prompt = _raw_tokens(response.get("input_messages"))
        if prompt is not None:
            self.prompt_ids = prompt

    def tokens(self) -> tuple[int | None, int | None]:
        usage = (self.final or {}).get("usage")
        if not isinstance(usage, dict):
            return None, None
        return usage.get("input_tokens"), usage.get("output_tokens")

    def choices(self) -> list[ChoiceRecord]:
        if self.final is not None:  # the authority, when it came
            text, logprobs, ids, finish = _read_final(self.final)
        else:
            text, logprobs, ids, finish = self._text, self._logprobs, None, None
        values = _logprob_values(logprobs, ids)
        self.logprobs_missing = 1 if values is None and (ids or text) else 0
        self.choice_count = 1
        tops = None
        if self.keep_top and values is not None:
            tops = [e.get("top_logprobs") for e in logprobs]
        return [ChoiceRecord(index=0, finish_reason=finish, text="".join(text) or None,
                             completion_ids=ids, completion_logprobs=values, top_logprobs=tops,
                             token_source="engine" if ids is not None else "none")]

    def reassembled(self, *, with_logprobs: bool) -> dict[str, Any]:
        """The final response object; what the proxy asked for is taken out again."""
        if self.final is None:
            return {"id": self.response_id, "object": "response", "model": self.model,
                    "status": "incomplete", "output": []}
        if with_logprobs:
            return self.final
        response = msgspec.json.decode(encode(self.final))  # a copy: capture keeps its own
        return _strip_response(response, Injected(logprobs=True, token_ids=True))


def _read_final(final: dict[str, Any]) -> tuple[list[str], list[Any], list[int] | None,
                                                str | None]:
    """The final response's output text, its logprob entries, the output ids and the
    finish reason in chat's words."""
    text: list[str] = []
    logprobs: list[Any] = []
    calls = False
    for item in final.get("output") or ():
        if item.get("type") == "message":
            for part in item.get("content") or ():
                if part.get("type") == "output_text":
                    text.append(part.get("text") or "")
                    logprobs.extend(part.get("logprobs") or ())
        elif item.get("type") == "function_call":
            calls = True
    status = final.get("status")
    finish = ("length" if status == "incomplete" else "tool_calls" if calls
              else "stop" if status == "completed" else status)
    return text, logprobs, _raw_tokens(final.get("output_messages")), finish


def _logprob_values(logprobs: list[Any], ids: list[int] | None) -> list[float] | None:
    """The logprobs, when every entry has one and they match the ids one for one."""
    values = [e.get("logprob") for e in logprobs if isinstance(e, dict)]
    if not values or any(v is None for v in values) or (ids and len(ids) != len(values)):
        return None
    return values


def _raw_tokens(messages: Any) -> list[int] | None:
    """vLLM's ``raw_message_tokens`` entries, joined in order."""
    if not isinstance(messages, list) or not messages:
        return None
    ids: list[int] = []
    for entry in messages:
        tokens = entry.get("tokens") if isinstance(entry, dict) else None
        if not isinstance(tokens, list):
            return None
        ids.extend(tokens)
    return ids
