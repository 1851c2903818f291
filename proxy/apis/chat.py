"""Chat completions and legacy completions: OpenAI's own shapes, as vLLM serves them."""

from __future__ import annotations

from typing import Any

from tracetap.proxy.assemble import Capture
from tracetap.proxy.inject import CHAT, COMPLETIONS, Injected, prepare, strip_body, strip_chunk
from tracetap.proxy.sse import Event, encode_event

DONE = b"[DONE]"


class OpenAIApi:
    ends_with_done = True  # so a stream needing no rewrite can be relayed as raw bytes

    def __init__(self, endpoint: str, route: str, path: str):
        self.endpoint = endpoint
        self.route = route
        self.path = path

    def prepare(self, payload: dict[str, Any], flavor: str) -> Injected:
        return prepare(payload, self.endpoint, flavor)

    def strip_body(self, body: bytes, injected: Injected) -> bytes:
        return strip_body(body, injected)

    def strip_event(self, event: Event, injected: Injected) -> bytes:
        assert event.data is not None
        chunk = strip_chunk(event.data, injected)
        return b"" if chunk is None else encode_event(chunk)

    def is_end(self, data: bytes) -> bool:
        return data == DONE

    def capture(self, injected: Injected) -> Capture:
        return Capture(self.endpoint, keep_top_logprobs=injected.client_top_logprobs > 0)


CHAT_API = OpenAIApi(CHAT, "chat_completions", "/v1/chat/completions")
COMPLETIONS_API = OpenAIApi(COMPLETIONS, "completions", "/v1/completions")
