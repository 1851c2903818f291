"""The Anthropic Messages API, captured natively (``--translate none``).

No engine returns token ids or logprobs for Messages (vLLM ignores those fields there),
so nothing is asked for and nothing is stripped: the reply is relayed as it came and
stored as text with ``token_source = none``. Token-exact capture of a Messages harness
goes through translation to chat completions, the default.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tracetap.proxy.apis import CaptureBase, Injected
from tracetap.proxy.apis.chat.wire import decode_event
from tracetap.proxy.http.sse import Event
from tracetap.storage.records import ChoiceRecord

_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
           "tool_use": "tool_calls"}


class MessagesApi:
    endpoint = "messages"
    route = "messages"
    path = "/v1/messages"
    ends_with_done = False  # the end is an event with data, not [DONE]
    speaks_chat = continuable = cuts_prompt_ids = routed_experts = prompt_in_request = False

    def prepare(self, payload: dict[str, Any], flavor: str) -> Injected:
        return Injected()

    def strip_body(self, body: bytes, injected: Injected) -> bytes:
        return body

    def strip_event(self, event: Event, injected: Injected) -> bytes:
        return event.raw

    def is_end(self, data: bytes) -> bool:
        return False  # message_stop carries data: see MessagesCapture.ended

    def capture(self, injected: Injected) -> MessagesCapture:
        return MessagesCapture()


class MessagesCapture(CaptureBase):
    def __init__(self) -> None:
        super().__init__()
        self._message: dict[str, Any] | None = None
        self._blocks: dict[int, dict[str, Any]] = {}
        self._usage: dict[str, Any] = {}
        self._stop: str | None = None

    def add(self, data: bytes) -> None:
        event = decode_event(data, self.errors)
        if event is None:
            return
        kind = event.get("type")
        if kind == "message":  # a whole, non-streamed reply
            self._whole(event)
        elif kind == "message_start" and isinstance(event.get("message"), dict):
            self._start(event["message"])
        elif kind == "content_block_start":
            self._blocks[event.get("index", len(self._blocks))] = dict(
                event.get("content_block") or {})
        elif kind == "content_block_delta":
            self._delta(event)
        elif kind == "message_delta":
            self._stop = (event.get("delta") or {}).get("stop_reason") or self._stop
            self._usage.update(event.get("usage") or {})
        elif kind == "message_stop":
            self.ended = True
        elif kind == "error":
            if len(self.errors) < 5:
                self.errors.append(f"upstream stream error: {event.get('error')}")
        elif kind not in ("content_block_stop", "ping"):
            self.unknown_events += 1  # relayed as it came; counted

    def _whole(self, message: dict[str, Any]) -> None:
        self._start(message)
        for i, block in enumerate(message.get("content") or ()):
            self._blocks[i] = dict(block)
        self._stop = message.get("stop_reason")

    def _delta(self, event: dict[str, Any]) -> None:
        block = self._blocks.setdefault(event.get("index", 0), {"type": "text", "text": ""})
        delta = event.get("delta") or {}
        for key, field in (("text", "text"), ("partial_json", "input_json"),
                           ("thinking", "thinking")):
            if key in delta:
                block[field] = (block.get(field) or "") + delta[key]

    def _start(self, message: dict[str, Any]) -> None:
        self._message = message
        self.response_id = message.get("id") or self.response_id
        self.model = message.get("model") or self.model
        self._usage.update(message.get("usage") or {})

    def tokens(self) -> tuple[int | None, int | None]:
        return self._usage.get("input_tokens"), self._usage.get("output_tokens")

    def choices(self) -> list[ChoiceRecord]:
        text = "".join(b.get("text") or "" for _, b in sorted(self._blocks.items())
                       if b.get("type") == "text")
        self.logprobs_missing = 1 if self._blocks else 0
        self.choice_count = 1
        return [ChoiceRecord(index=0, finish_reason=_FINISH.get(self._stop or "", self._stop),
                             text=text or None, completion_ids=None, completion_logprobs=None,
                             top_logprobs=None, token_source="none")]

    def reassembled(self, *, with_logprobs: bool) -> dict[str, Any]:
        content = []
        for _, block in sorted(self._blocks.items()):
            block = dict(block)
            if "input_json" in block:
                try:
                    block["input"] = msgspec.json.decode(block.pop("input_json"))
                except msgspec.DecodeError:
                    block["input"] = {}
            content.append(block)
        message = dict(self._message or {"id": self.response_id, "type": "message",
                                         "role": "assistant", "model": self.model})
        message.update(content=content, stop_reason=self._stop, usage=self._usage)
        return message
