"""A rewritten turn, written in the client's own API: a body, or a stream replayed as SSE.

The model's reply (a chat completion) gets the overlay's message in place of the model's;
its logprobs and token ids go (they were the model's, not these). A translated call is
converted back exactly like an upstream reply (``from_chat`` / ``StreamTranslator``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tracetap.proxy.apis.chat.wire import encode
from tracetap.proxy.http.sse import encode_event
from tracetap.proxy.overlays.hooks import Rewrite

if TYPE_CHECKING:
    from tracetap.proxy.call.driver import ModelCall

_ENGINE_ONLY = ("prompt_token_ids", "prompt_logprobs", "kv_transfer_params")


def rewritten_chat(chat: dict[str, Any], rewrite: Rewrite) -> dict[str, Any]:
    """The model's chat reply with the overlay's turn as its only choice."""
    message: dict[str, Any] = {"role": "assistant", "content": rewrite.content}
    if rewrite.tool_calls:
        message["tool_calls"] = [
            {
                "id": t.id or f"call_overlay_{i}",
                "type": "function",
                "function": {"name": t.name, "arguments": t.arguments},
            }
            for i, t in enumerate(rewrite.tool_calls)
        ]
    choices = chat.get("choices") or [{}]
    finish = choices[0].get("finish_reason") if isinstance(choices[0], dict) else None
    if rewrite.tool_calls:
        finish = "tool_calls"
    elif finish in (None, "tool_calls"):
        finish = "stop"
    out = {k: v for k, v in chat.items() if k not in ("choices", *_ENGINE_ONLY)}
    out["choices"] = [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}]
    return out


def client_body(call: ModelCall, chat: dict[str, Any]) -> bytes:
    """A whole chat reply as the client's API spells it."""
    if call.translation is not None:
        return encode(call.translation.from_chat(chat, call.request.client_payload))
    return encode(chat)


def client_stream(call: ModelCall, chat: dict[str, Any]) -> bytes:
    """A whole chat reply as the client's stream: chunks, then the end the API uses."""
    translator = None
    if call.translation is not None:
        translator = call.translation.StreamTranslator(call.request.client_payload)
    return _stream(call, _chunks(chat), translator)


def client_tail(call: ModelCall, chat: dict[str, Any], translator: Any) -> bytes:
    """The end of a stream whose text the client already has: the turn's tool calls, its
    finish and the stream's end, continuing the client's ``translator`` (as it was before
    the first tool call; None when the client speaks chat)."""
    return _stream(call, _chunks(chat)[1:], translator)


def _stream(call: ModelCall, chunks: list[dict[str, Any]], translator: Any) -> bytes:
    if translator is not None:
        out = [piece for chunk in chunks for piece in translator.feed(chunk)]
        return b"".join([*out, *translator.finish()])
    if call.request.injected.usage:  # the client did not ask for the usage chunk
        chunks = [c for c in chunks if c["choices"]]
    return b"".join([*(encode_event(encode(c)) for c in chunks), b"data: [DONE]\n\n"])


def _chunks(chat: dict[str, Any]) -> list[dict[str, Any]]:
    head = {
        "id": chat.get("id"),
        "object": "chat.completion.chunk",
        "created": chat.get("created"),
        "model": chat.get("model"),
    }
    choice = chat["choices"][0]
    message = choice["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            **head,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }

    chunks = [chunk({"role": "assistant", "content": message.get("content") or ""})]
    for i, call in enumerate(message.get("tool_calls") or ()):
        chunks.append(chunk({"tool_calls": [{"index": i, **call}]}))
    chunks.append(chunk({}, choice.get("finish_reason")))
    if chat.get("usage") is not None:
        chunks.append({**head, "choices": [], "usage": chat["usage"]})
    return chunks
