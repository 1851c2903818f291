"""The parts of OpenAI-compatible responses the proxy reads, as msgspec view Structs.

The one owner of the chat wire shape: capture (``capture``), translation
(``reply``) and overlays read chat replies and chunks through these Structs and
decoders, so an engine's spelling (``reasoning`` or ``reasoning_content``) is read the
same everywhere. Only the fields the proxy reads are declared; everything else is ignored
on decode and forwarded untouched in the original bytes.
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
    """A reply's message, or a stream chunk's delta."""

    role: str | None = None
    content: str | None = None
    # Engines name the reasoning text reasoning_content (DeepSeek, SGLang, llama.cpp,
    # older vLLM) or reasoning (newer vLLM); read it through ``reasoning_text``.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None

    @property
    def reasoning_text(self) -> str | None:
        """The reasoning text, whichever field carried it (some engines send both with
        the same text: one is taken, never both)."""
        return self.reasoning_content or self.reasoning


class ChatTextChoice(View):
    """A chat choice without its logprobs (decoding skips them: translation's stream)."""

    index: int = 0
    message: Message | None = None
    delta: Message | None = None
    finish_reason: str | None = None
    stop_reason: Any = None  # vLLM: the stop string (or token id) that ended it
    matched_stop: Any = None  # SGLang's name for it


class ChatChoice(ChatTextChoice):
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None
    # SGLang's non-stream chat with ``return_token_ids`` (the client's own ask).
    response_token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class SglExt(View):
    """SGLang's extension object: the chat ids the proxy asks for (proxy.apis.chat.inject)."""

    input_ids: list[int] | None = None
    output_ids: list[list[int]] | None = None  # one list per choice, each whole


class LogprobEntries(View):
    content: list[dict[str, Any]] | None = None


class ChatEntriesChoice(ChatTextChoice):
    """A chat choice with its logprob entries as they came (translation passes them on
    to the client, ``bytes`` included)."""

    logprobs: LogprobEntries | None = None


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


class PromptDetails(View):
    cached_tokens: int | None = None


class CompletionDetails(View):
    reasoning_tokens: int | None = None


class Usage(View):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    prompt_tokens_details: PromptDetails | None = None
    completion_tokens_details: CompletionDetails | None = None


class ChatTextBody(View):
    """A chat reply or chunk as translation reads it: no logprobs, ids or names."""

    created: int | None = None
    choices: list[ChatTextChoice] = []
    usage: Usage | None = None
    error: Any = None  # an error object sent in place of a chunk


class ChatBody(ChatTextBody):
    id: str | None = None
    model: str | None = None
    choices: list[ChatChoice] = []
    prompt_token_ids: list[int] | None = None
    sglext: SglExt | None = None


class ChatEntriesBody(ChatTextBody):
    choices: list[ChatEntriesChoice] = []


class CompletionBody(View):
    id: str | None = None
    model: str | None = None
    created: int | None = None
    choices: list[CompletionChoice] = []
    usage: Usage | None = None


decode_chat = msgspec.json.Decoder(ChatBody).decode
decode_chat_text = msgspec.json.Decoder(ChatTextBody).decode
decode_chat_entries = msgspec.json.Decoder(ChatEntriesBody).decode
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


def first_choice(choices: list[ChatTextChoice]) -> ChatTextChoice | None:
    """Choice 0 (translation and overlays never ask for ``n > 1``)."""
    return next((c for c in choices if c.index == 0), None)


def as_chat_entries(value: Any) -> ChatEntriesBody:
    """An already decoded chat reply or chunk (a dict) as the same Structs; raises
    msgspec.ValidationError when a field has an odd type."""
    return msgspec.convert(value, ChatEntriesBody)
