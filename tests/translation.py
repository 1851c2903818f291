"""What the two translation test files (Responses, Messages) share: decoding a translated
SSE stream, asking the mock engine directly, and the turn a chat harness would append."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable


def decode_named_events(raw: list[bytes], validate: Callable[[dict], object]) -> list[dict]:
    """SSE bytes → event payloads; each event's name must be its payload's type, and each
    payload must pass `validate` (the SDK's own event type adapter)."""
    out = []
    for event in b"".join(raw).split(b"\n\n")[:-1]:
        name, data = event.split(b"\n")
        assert name.startswith(b"event: ") and data.startswith(b"data: ")
        payload = json.loads(data[6:])
        assert payload["type"] == name[7:].decode()
        validate(payload)
        out.append(payload)
    return out


def engine_chat(engine_url: str, body: dict) -> dict:
    """A chat completion straight from the engine, as a chat harness would get it."""
    post = urllib.request.Request(engine_url + "/chat/completions", method="POST",
                                  data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(post, timeout=30) as answer:
        return json.load(answer)


def harness_turn(message: dict) -> dict:
    """The assistant message a chat harness appends to its history after `message`."""
    return {"role": "assistant", "content": message["content"],
            **({"tool_calls": message["tool_calls"]} if message.get("tool_calls") else {})}
