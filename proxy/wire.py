"""The parts of OpenAI-compatible responses the proxy reads, as msgspec view Structs.

Only the fields capture needs are declared; everything else is ignored on decode and
forwarded untouched in the original bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec


class View(msgspec.Struct, kw_only=True, gc=False):
    pass


class TopLogprob(View):
    token: str | None = None
    logprob: float | None = None


class LogprobEntry(View):
    token: str | None = None
    logprob: float | None = None
    id: int | None = None  # llama.cpp puts the token id here
    top_logprobs: list[TopLogprob] | None = None


class ChatLogprobs(View):
    content: list[LogprobEntry] | None = None


class FunctionCall(View):
    name: str | None = None
    arguments: str | None = None


class ToolCall(View):
    index: int | None = None
    id: str | None = None
    type: str | None = None
    function: FunctionCall | None = None


class Message(View):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(View):
    index: int = 0
    message: Message | None = None
    delta: Message | None = None
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class LegacyLogprobs(View):
    tokens: list[str] | None = None
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None


class CompletionChoice(View):
    index: int = 0
    text: str | None = None
    logprobs: LegacyLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class Usage(View):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None


class ChatBody(View):
    id: str | None = None
    model: str | None = None
    created: int | None = None
    choices: list[ChatChoice] = []
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class CompletionBody(View):
    id: str | None = None
    model: str | None = None
    created: int | None = None
    choices: list[CompletionChoice] = []
    usage: Usage | None = None


decode_chat = msgspec.json.Decoder(ChatBody).decode
decode_completion = msgspec.json.Decoder(CompletionBody).decode
decode_object = msgspec.json.Decoder(dict[str, Any]).decode
encode = msgspec.json.encode


def decode_event(data: bytes, errors: list[str]) -> dict[str, Any] | None:
    """One reply body or stream event as a dict; bad JSON is noted (a few), never raised."""
    try:
        return decode_object(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        if len(errors) < 5:
            errors.append(f"unparseable upstream data: {exc}")
        return None
