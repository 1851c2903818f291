"""What the two translation test files (Responses, Messages) share: decoding a translated
SSE stream, asking the mock engine directly, and the turn a chat harness would append."""

from __future__ import annotations

import json
from collections.abc import Callable

from helpers.http import post


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
    status, reply = post(engine_url + "/chat/completions", body)
    assert status == 200, reply
    return reply


def harness_turn(message: dict) -> dict:
    """The assistant message a chat harness appends to its history after `message`."""
    return {"role": "assistant", "content": message["content"],
            **({"tool_calls": message["tool_calls"]} if message.get("tool_calls") else {})}


def finish_on_last_chunk(chunks: list[dict]) -> list[dict]:
    """``chunks`` (``chat_upstreams.stream_chunks``) as vLLM streams a ``length`` or stop-string
    ending: the finish_reason (and stop_reason) on the last chunk that carries a delta,
    with its text, instead of an empty chunk of its own."""
    out = [dict(c, choices=[dict(choice) for choice in c["choices"]]) for c in chunks]
    at = next((i for i, c in enumerate(out)
               if c["choices"] and c["choices"][0]["finish_reason"]), None)
    if not at:  # no finish_reason, or nothing before it to carry it
        return out
    finish = out.pop(at)["choices"][0]
    last = out[at - 1]["choices"][0]
    last["finish_reason"] = finish["finish_reason"]
    if "stop_reason" in finish:
        last["stop_reason"] = finish["stop_reason"]
    return out
