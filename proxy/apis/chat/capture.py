"""Chat completions and legacy completions captured: the two ``WireApi`` objects, and
upstream replies (one body, or stream chunks) → what storage keeps of each choice.

Token ids, in order of trust: engine ids (``token_ids``), ids carried by logprob
entries (vLLM's ``"token_id:N"`` strings, llama.cpp's ``id``), else none.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import msgspec

from tracetap.proxy.apis import Injected
from tracetap.proxy.apis.chat import CHAT, COMPLETIONS
from tracetap.proxy.apis.chat.inject import prepare, strip_body, strip_chunk
from tracetap.proxy.apis.chat.pieces import (
    Pieces,
    add_tool_calls,
    completion_ids,
    logprobs_view,
)
from tracetap.proxy.apis.chat.prompt_cut import decode_ids
from tracetap.proxy.apis.chat.stream_step import ChatStreamStep
from tracetap.proxy.apis.chat.wire import (
    ChatBody,
    ChatChoice,
    ChatLogprobs,
    CompletionBody,
    CompletionChoice,
    Message,
    SglExt,
    Usage,
    decode_chat,
    decode_completion,
)
from tracetap.proxy.http.sse import Event, encode_event
from tracetap.storage.codec import unpack_ids
from tracetap.storage.records import ChoiceRecord

DONE = b"[DONE]"


class OpenAIApi:
    ends_with_done = True  # so a stream needing no rewrite can be relayed as raw bytes
    routed_experts = True  # vLLM returns MoE routing for both (call/routed_experts.py)

    def __init__(self, endpoint: str, route: str, path: str):
        self.endpoint = endpoint
        self.route = route
        self.path = path
        chat = endpoint == CHAT
        # Chat streams continue after a weight sync and carry their prompt's ids in the
        # first chunk; a legacy completions prompt may be the token ids themselves.
        self.speaks_chat = self.continuable = self.cuts_prompt_ids = chat
        self.prompt_in_request = not chat

    def prepare(self, payload: dict[str, Any], flavor: str) -> Injected:
        return prepare(payload, self.endpoint, flavor)

    def strip_body(self, body: bytes, injected: Injected) -> bytes:
        return strip_body(body, injected)

    def strip_event(self, event: Event, injected: Injected) -> bytes:
        assert event.data is not None
        chunk = strip_chunk(event.data, injected)
        return b"" if chunk is None else encode_event(chunk)

    def event_step(self, capture: Any, injected: Injected) -> ChatStreamStep | None:
        """One chat stream's ``capture.add`` and ``strip_event`` together, where its
        chunks can be cut by byte ranges (proxy.apis.chat.stream_step)."""
        if self.endpoint != CHAT or not isinstance(capture, Capture) or injected.experts:
            return None
        return ChatStreamStep(capture, injected)

    def is_end(self, data: bytes) -> bool:
        return data == DONE

    def capture(self, injected: Injected) -> Capture:
        return Capture(self.endpoint, keep_top_logprobs=injected.client_top_logprobs > 0)


_PromptDecoder = Callable[[bytes], tuple[list[int] | None, bytes | None]]


def _decode_whole(raw: bytes) -> tuple[list[int] | None, bytes | None]:
    return decode_ids(raw), None

class Capture:
    """Accumulates an upstream reply; ``choices()`` turns it into choice records."""

    def __init__(self, endpoint: str, *, keep_top_logprobs: bool = False):
        self.endpoint = endpoint
        self.keep_top = keep_top_logprobs
        self._decode = decode_chat if endpoint == CHAT else decode_completion
        self._choices: dict[int, Pieces] = {}
        self.model: str | None = None
        self.response_id: str | None = None
        self.created: int | None = None
        self.usage: Usage | None = None
        self._prompt_ids: list[int] | None = None
        self._prompt_raw: bytes | None = None  # cut out of a chunk, decoded when read
        self._prompt_decode = _decode_whole
        self._prompt_packed: bytes | None = None  # the decoder's int32 bytes of them
        self.errors: list[str] = []
        self.logprobs_missing = 0
        self.ended = False  # chat streams end with the [DONE] sentinel instead
        self.choice_count = 0
        self.unknown_events = 0  # chat chunks have no event types

    @property
    def prompt_ids(self) -> list[int] | None:
        """The engine's prompt ids; ones cut out of a chunk (``add_prompt_ids``) are
        decoded here, on first read, off the stream's critical path."""
        self._decode_prompt()
        if self._prompt_ids is None and self._prompt_packed is not None:
            self._prompt_ids = unpack_ids(self._prompt_packed)  # a reader wants the list
        return self._prompt_ids

    def _decode_prompt(self) -> None:
        raw = self._prompt_raw
        if raw is not None:
            self._prompt_raw = None
            try:
                self._prompt_ids, self._prompt_packed = self._prompt_decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                if len(self.errors) < 5:
                    self.errors.append(f"unparseable upstream prompt_token_ids: {exc}")

    @prompt_ids.setter
    def prompt_ids(self, ids: list[int] | None) -> None:
        self._prompt_ids, self._prompt_raw, self._prompt_packed = ids, None, None

    @property
    def prompt_packed(self) -> bytes | None:
        """The prompt ids as int32 bytes when the decoder packed them (then no list of
        them need ever be made), else None: read ``prompt_ids``."""
        self._decode_prompt()
        return self._prompt_packed

    def add_prompt_ids(self, raw: bytes, decode: _PromptDecoder = _decode_whole) -> None:
        """The bytes of a ``prompt_token_ids`` array cut out of a chunk
        (``proxy.apis.chat.prompt_cut``): kept as they are until read, then given to ``decode``
        (``PromptPrefixes.decode_packed``: in the new tokens only), which returns
        ``(ids, None)`` or ``(None, packed ids)``."""
        self._prompt_ids, self._prompt_raw, self._prompt_decode = None, raw, decode
        self._prompt_packed = None

    def add(self, data: bytes) -> bool:
        """One non-stream body or one stream chunk; bad JSON is noted, never raised
        (returns whether it was read)."""
        try:
            body = self._decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            if len(self.errors) < 5:
                self.errors.append(f"unparseable upstream data: {exc}")
            return False
        self.add_head(body)
        if body.usage is not None:
            self.usage = body.usage
        if getattr(body, "prompt_token_ids", None) is not None:
            self.prompt_ids = body.prompt_token_ids
        for choice in body.choices:
            acc = self._choices.get(choice.index)
            if acc is None:
                acc = self._choices[choice.index] = Pieces()
            if isinstance(choice, ChatChoice):
                self._add_chat(acc, choice)
            else:
                self._add_completion(acc, choice)
        ext = getattr(body, "sglext", None)
        if ext is not None:
            self._add_sglext(ext)
        return True

    def add_head(self, body: ChatBody | CompletionBody) -> None:
        """What a body or chunk says of the whole reply (its id, model, creation)."""
        self.model = body.model or self.model
        self.response_id = body.id or self.response_id
        self.created = body.created or self.created

    def delta_adder(self, index: int) -> Callable[[Message | None, ChatLogprobs | None,
                                                     list[int] | None, str | None], None]:
        """Choice ``index``'s pieces, already decoded (proxy.apis.chat.stream_step): what
        ``add`` reads of a chunk whose choice has nothing else (no stop, no prompt ids)."""
        acc = self._choices.get(index)
        if acc is None:
            acc = self._choices[index] = Pieces()
        return functools.partial(self._add_delta, acc)

    def _add_sglext(self, ext: SglExt) -> None:
        """SGLang's whole ids of the prompt and of each choice (they replace any others)."""
        if ext.input_ids is not None:
            self.prompt_ids = ext.input_ids
        for index, ids in enumerate(ext.output_ids or ()):
            acc = self._choices.get(index)
            if acc is None:
                acc = self._choices[index] = Pieces()
            acc.engine_ids = list(ids)

    def _add_chat(self, acc: Pieces, choice: ChatChoice) -> None:
        if choice.prompt_token_ids is not None:
            self.prompt_ids = choice.prompt_token_ids
        if choice.stop_reason is not None:
            acc.stop = {"stop_reason": choice.stop_reason}
        elif choice.matched_stop is not None:
            acc.stop = {"matched_stop": choice.matched_stop}
        ids = choice.token_ids if choice.token_ids is not None else choice.response_token_ids
        self._add_delta(acc, choice.message or choice.delta, choice.logprobs, ids,
                        choice.finish_reason)

    def _add_delta(self, acc: Pieces, message: Message | None, logprobs: ChatLogprobs | None,
                   token_ids: list[int] | None, finish: str | None) -> None:
        """A reply's message or a chunk's delta (its text, reasoning and tool-call pieces),
        its logprob entries, ids and finish (run once per streamed token: inline)."""
        if message is not None:
            acc.role = message.role or acc.role
            if message.content:
                acc.text.append(message.content)
            reasoning = message.reasoning_content or message.reasoning  # reasoning_text
            if reasoning:
                acc.reasoning.append(reasoning)
            if message.tool_calls:
                add_tool_calls(acc, message.tool_calls)
        if logprobs is not None and logprobs.content:
            for entry in logprobs.content:
                acc.logprobs.append(entry.logprob)
                acc.tokens.append(entry.token)
                acc.ids.append(entry.id)
                if self.keep_top:
                    acc.tops.append([{"token": t.token, "logprob": t.logprob}
                                     for t in entry.top_logprobs or ()])
        if token_ids is not None:
            if acc.engine_ids is None:
                acc.engine_ids = []
            acc.engine_ids.extend(token_ids)
        if finish is not None:
            acc.finish_reason = finish

    def _add_completion(self, acc: Pieces, choice: CompletionChoice) -> None:
        if choice.text:
            acc.text.append(choice.text)
        if choice.prompt_token_ids is not None:
            self.prompt_ids = choice.prompt_token_ids
        lp = choice.logprobs
        if lp is not None and lp.tokens is not None:
            acc.tokens.extend(lp.tokens)
            acc.ids.extend([None] * len(lp.tokens))
            values = lp.token_logprobs or []
            acc.logprobs.extend(values[: len(lp.tokens)])
            acc.logprobs.extend([None] * (len(lp.tokens) - len(values)))
            if self.keep_top:
                acc.tops.extend(lp.top_logprobs or [None] * len(lp.tokens))
        self._add_common(acc, choice.token_ids, choice.finish_reason)

    @staticmethod
    def _add_common(acc: Pieces, token_ids: list[int] | None, finish: str | None) -> None:
        if token_ids is not None:
            if acc.engine_ids is None:
                acc.engine_ids = []
            acc.engine_ids.extend(token_ids)
        if finish is not None:
            acc.finish_reason = finish

    def continuable(self, ids_at_end: bool = False) -> bool:
        """Whether the reply so far can be continued token for token (proxy.call.continuation):
        one unfinished choice with the engine's ids, no tool call or reasoning text, and
        the prompt's ids known. ``ids_at_end``: the engine sends both ids only as the
        stream ends (SGLang's ``sglext``), so only the rest is asked now."""
        if len(self._choices) != 1 or (self.prompt_ids is None and not ids_at_end):
            return False
        [c] = self._choices.values()
        return ((c.engine_ids is not None or ids_at_end) and not c.tools and not c.reasoning
                and c.finish_reason is None)

    def token_counts(self) -> dict[int, int]:
        """Completion tokens received so far, per choice (proxy.policy.versions follows a stream
        by them): engine ids, else logprob entries."""
        return {i: len(c.engine_ids) if c.engine_ids is not None else len(c.tokens)
                for i, c in self._choices.items()}

    def tokens(self) -> tuple[int | None, int | None]:
        """Prompt and completion tokens, as the upstream's usage reports them."""
        if self.usage is None:
            return None, None
        return self.usage.prompt_tokens, self.usage.completion_tokens

    def choices(self) -> list[ChoiceRecord]:
        records = []
        self.logprobs_missing = 0
        self.choice_count = len(self._choices)
        for index in sorted(self._choices):
            acc = self._choices[index]
            ids, source = completion_ids(acc)
            logprobs = None
            if acc.logprobs and all(v is not None for v in acc.logprobs):
                logprobs = acc.logprobs
            if logprobs is not None and ids is not None and len(ids) != len(logprobs):
                logprobs = None
            if logprobs is None and (ids or acc.text):
                self.logprobs_missing += 1
            strs = None  # no ids: the engine's own strings let the writer verify a retokenization
            if ids is None and acc.tokens and all(t is not None for t in acc.tokens):
                strs = acc.tokens
            records.append(ChoiceRecord(
                index=index,
                finish_reason=acc.finish_reason,
                text="".join(acc.text) if acc.text else None,
                completion_ids=ids,
                completion_logprobs=logprobs,
                top_logprobs=acc.tops if self.keep_top and acc.tops else None,
                token_source=source,
                token_strs=strs,
            ))
        return records

    def reassembled(self, *, with_logprobs: bool) -> dict[str, Any]:
        """A stream put back together in the shape of the non-streaming reply."""
        chat = self.endpoint == CHAT
        choices = []
        for index in sorted(self._choices):
            acc = self._choices[index]
            text = "".join(acc.text) if acc.text else None
            out: dict[str, Any] = {"index": index}
            if chat:
                message: dict[str, Any] = {"role": acc.role or "assistant", "content": text}
                if acc.reasoning:
                    message["reasoning_content"] = "".join(acc.reasoning)
                if acc.tools:
                    message["tool_calls"] = [
                        {"id": t["id"], "type": t["type"] or "function",
                         "function": {"name": t["name"], "arguments": "".join(t["arguments"])}}
                        for _, t in sorted(acc.tools.items())
                    ]
                out["message"] = message
            else:
                out["text"] = text or ""
            out["logprobs"] = logprobs_view(acc, chat) if with_logprobs else None
            out["finish_reason"] = acc.finish_reason
            out |= acc.stop  # what ended it: a stop string's token is in no text (drift)
            choices.append(out)
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.usage is not None:
            body["usage"] = msgspec.to_builtins(self.usage)
        return body


CHAT_API = OpenAIApi(CHAT, "chat_completions", "/v1/chat/completions")
COMPLETIONS_API = OpenAIApi(COMPLETIONS, "completions", "/v1/completions")
