"""Wire shapes of the mock engine: request Structs and vLLM/OpenAI/llama.cpp response bodies."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal

import msgspec

from tracetap.demo import tokenizer as tok
from tracetap.demo.generate import Completion, Event, logprob_rows

# "llamacpp" is the older name of "llama-server" (llama.cpp's C++ server).
Flavor = Literal["vllm", "sglang", "openai", "llama-server", "llamacpp", "llama-cpp-python"]
FLAVORS: tuple[Flavor, ...] = ("vllm", "sglang", "openai", "llama-server", "llamacpp",
                               "llama-cpp-python")
LLAMA_SERVER = frozenset({"llama-server", "llamacpp"})


class EngineRequest(msgspec.Struct, kw_only=True):
    """Fields both endpoints read; ``mock_*`` fields inject faults (see engine docs)."""

    model: str | None = None
    n: int | None = None
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool | None = None
    return_routed_experts: bool | None = None  # SGLang's switch (demo/experts.py)
    # SGLang's (demo/sglang.py): its request id, and its chat ids in ``sglext``
    rid: str | None = None
    return_input_ids_in_sglext: bool | None = None
    return_output_ids_in_sglext: bool | None = None
    mock_delay_s: float = 0.0
    mock_chunk_delay_s: float | None = None
    mock_fail_after_chunks: int | None = None
    mock_status: int | None = None
    mock_completion_tokens: int | None = None
    mock_garbage: bool = False
    mock_tool_rounds: int | None = None
    mock_content: str | None = None
    mock_bad_tool_args: float | None = None


class ChatRequest(EngineRequest, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class CompletionRequest(EngineRequest, kw_only=True):
    prompt: Any
    logprobs: int | None = None
    echo: bool | None = None  # the prompt sent back before the answer, as vLLM does


# What the real OpenAI API accepts; anything else is "Unrecognized request argument".
# fmt: off
_COMMON = frozenset({
    "model", "n", "max_tokens", "seed", "stop", "stream", "stream_options", "temperature",
    "top_p", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "user",
})
OPENAI_FIELDS: dict[type[EngineRequest], frozenset[str]] = {
    ChatRequest: _COMMON | {
        "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
        "parallel_tool_calls", "response_format", "metadata", "store", "modalities", "audio",
        "prediction", "reasoning_effort", "service_tier", "functions", "function_call",
        "prompt_cache_key", "safety_identifier", "verbosity", "web_search_options",
    },
    CompletionRequest: _COMMON | {"prompt", "best_of", "echo", "suffix"},
}
# fmt: on


def error_body(flavor: Flavor, status: int, message: str, param: str | None = None) -> dict:
    """The one error shape: vLLM names the type after the status, OpenAI by category."""
    if flavor == "sglang":  # SGLang 0.5.23 serving_base.py: the error object itself
        kind = "BadRequest" if status == 400 else "InternalServerError" if status >= 500 else ""
        return {"object": "error", "message": message, "type": kind, "param": param,
                "code": status}
    if flavor == "vllm":
        try:
            kind = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
        except ValueError:
            kind = ""
        kind = kind if kind.endswith("Error") else kind + "Error"
        return {"error": {"message": message, "type": kind, "param": param, "code": status}}
    kind, code = "invalid_request_error", None
    if status == 429:
        kind, code = "requests", "rate_limit_exceeded"
    elif status >= 500:
        kind = "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class InputError(ValueError):
    """A request the mock cannot render as a chat conversation: a 400 naming ``param``."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatTurn:
    """A Responses or Messages request as the equivalent chat-completions conversation."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: Any


@dataclass
class Shape:
    """Per-request decisions about what the response carries."""

    flavor: Flavor
    req: EngineRequest
    model: str
    id: str
    created: int
    top_k: int | None  # None: logprobs not requested

    @property
    def vllm(self) -> bool:
        return self.flavor == "vllm"

    @property
    def llama_cpp_python(self) -> bool:
        return self.flavor == "llama-cpp-python"

    @property
    def want_ids(self) -> bool:
        return self.vllm and bool(self.req.return_token_ids)

    @property
    def include_usage(self) -> bool:
        # llama-cpp-python ignores stream_options: its streams never carry usage.
        return not self.llama_cpp_python and bool(
            (self.req.stream_options or {}).get("include_usage"))

    def emitted(self, c: Completion) -> list[int]:
        """The completion's tokens as this flavor reports them: llama-cpp-python stops
        before an end-of-generation token, so the EOS is in neither logprobs nor usage."""
        if self.llama_cpp_python and c.token_ids and c.token_ids[-1] == tok.EOS:
            return c.token_ids[:-1]
        return c.token_ids

    def token_text(self, token_id: int) -> str:
        """A token's string in logprobs: llama-cpp-python detokenizes one token without
        special tokens and drops bytes that are not valid UTF-8 alone."""
        if self.llama_cpp_python:
            if token_id >= 256:
                return ""
            return tok.token_bytes(token_id).decode("utf-8", errors="ignore")
        return tok.token_str(token_id)

    def envelope(self, obj: str, choices: list[dict]) -> dict[str, Any]:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        body["choices"] = choices
        if self.flavor == "openai" and self.include_usage and self.req.stream:
            body["usage"] = None  # OpenAI sends usage: null on every chunk but the last
        return body

    def usage(self, prompt_tokens: int, completions: Sequence[Completion]) -> dict[str, Any]:
        out = sum(len(self.emitted(c)) for c in completions)
        usage = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + out,
            "completion_tokens": out,
        }
        return usage | ({"prompt_tokens_details": None} if self.vllm else {})

    def usage_chunk(self, obj: str, prompt_tokens: int, completions: Sequence[Completion]) -> dict:
        return self.envelope(obj, []) | {"usage": self.usage(prompt_tokens, completions)}


# ---- logprobs --------------------------------------------------------------------------


def _chat_entry(shape: Shape, token_id: int, logprob: float) -> dict[str, Any]:
    """llama-server adds the token id; llama-cpp-python has no id and null bytes."""
    entry: dict[str, Any] = {"id": token_id} if shape.flavor in LLAMA_SERVER else {}
    entry |= {"token": shape.token_text(token_id), "logprob": logprob}
    entry["bytes"] = None if shape.llama_cpp_python else list(tok.token_bytes(token_id))
    return entry


def _reported(shape: Shape, c: Completion, start: int, ids: Sequence[int]) -> Sequence[int]:
    """``ids`` (a slice of the completion from ``start``) less what the flavor omits."""
    emitted = len(shape.emitted(c))
    return ids[: max(0, emitted - start)]


def chat_logprobs(shape: Shape, c: Completion, start: int, ids: Sequence[int]) -> dict | None:
    if shape.top_k is None:
        return None
    content = []
    ids = _reported(shape, c, start, ids)
    for token_id, row in zip(ids, logprob_rows(c.key, ids, start, shape.top_k)):
        entry = _chat_entry(shape, token_id, row.logprob)
        entry["top_logprobs"] = [_chat_entry(shape, t, lp) for t, lp in row.top]
        content.append(entry)
    return {"content": content}


def completion_logprobs(shape: Shape, c: Completion, start: int, ids: Sequence[int]) -> dict | None:
    """vLLM's legacy shape: each dict holds the sampled token plus the top k (k=0: 1 entry)."""
    if shape.top_k is None:
        return None
    ids = _reported(shape, c, start, ids)
    rows = logprob_rows(c.key, ids, start, shape.top_k)
    offset = sum(len(shape.token_text(t)) for t in c.token_ids[:start])
    tokens, offsets = [shape.token_text(t) for t in ids], []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    top = [
        {shape.token_text(t): lp for t, lp in [(i, row.logprob), *row.top]}
        for i, row in zip(ids, rows)
    ]
    token_logprobs = [r.logprob for r in rows]
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens} | {
        "top_logprobs": top
    }


# ---- chat ------------------------------------------------------------------------------


def _message(shape: Shape, c: Completion) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": c.content}
    if shape.vllm:
        return message | {"reasoning_content": None, "tool_calls": c.tool_calls}
    return message | ({"tool_calls": c.tool_calls} if c.tool_calls else {})


def chat_body(shape: Shape, prompt_ids: list[int], completions: list[Completion]) -> dict:
    choices = []
    for i, c in enumerate(completions):
        logprobs = chat_logprobs(shape, c, 0, c.token_ids)
        choice = {"index": i, "message": _message(shape, c), "logprobs": logprobs}
        choice["finish_reason"] = c.finish_reason
        if shape.vllm:  # non-streamed vLLM bodies spell out unset fields as null
            choice |= {"stop_reason": c.stop_reason}
            choice["token_ids"] = c.token_ids if shape.want_ids else None
        choices.append(choice)
    body = shape.envelope("chat.completion", choices)
    body["usage"] = shape.usage(len(prompt_ids), completions)
    if shape.vllm:
        body["prompt_logprobs"] = None
        body["prompt_token_ids"] = prompt_ids if shape.want_ids else None
    return body


def _delta(c: Completion, event: Event) -> dict[str, Any]:
    if event.kind == "content":
        return {"content": event.text}
    if event.kind == "hidden":
        return {} if c.tool_calls else {"content": ""}
    call = c.tool_calls[event.tool_index]
    if event.kind == "tool_head":
        head = {"index": event.tool_index, "id": call["id"], "type": "function"}
        head["function"] = {"name": call["function"]["name"], "arguments": ""}
        return {"tool_calls": [head]}
    return {"tool_calls": [{"index": event.tool_index, "function": {"arguments": event.text}}]}


def chat_chunks(shape: Shape, prompt_ids: list[int], completions: list[Completion]) -> Iterator:
    """A role chunk per choice, then one chunk per event, choices interleaved like vLLM."""
    obj = "chat.completion.chunk"
    for i in range(len(completions)):
        role = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        chunk = shape.envelope(obj, [role | {"finish_reason": None}])
        if i == 0 and shape.want_ids:
            chunk["prompt_token_ids"] = prompt_ids
        yield chunk
    for step in range(max(len(c.events) for c in completions)):
        for i, c in enumerate(completions):
            if step >= len(c.events):
                continue
            event, last = c.events[step], step == len(c.events) - 1
            logprobs = chat_logprobs(shape, c, event.start, event.ids)
            choice = {"index": i, "delta": _delta(c, event), "logprobs": logprobs}
            choice["finish_reason"] = c.finish_reason if last else None
            if shape.vllm and last:
                choice["stop_reason"] = c.stop_reason
            if shape.want_ids:
                choice["token_ids"] = event.ids
            yield shape.envelope(obj, [choice])
    if shape.include_usage:
        yield shape.usage_chunk(obj, len(prompt_ids), completions)


# ---- completions -----------------------------------------------------------------------


def _text_choice(
    shape: Shape, index: int, c: Completion, events: Sequence[Event], prompt: list[int] | None
) -> dict[str, Any]:
    """A whole choice (all events, prompt given) or one streamed step of it."""
    start, ids = events[0].start, [t for e in events for t in e.ids]
    last = events[-1] is c.events[-1]
    text = "".join(e.text for e in events)
    logprobs = completion_logprobs(shape, c, start, ids)
    if prompt is not None and getattr(shape.req, "echo", None):
        text, logprobs = _echoed(shape, prompt, text, logprobs)
    choice = {"index": index, "text": text, "logprobs": logprobs}
    choice["finish_reason"] = c.finish_reason if last else None
    if shape.vllm:
        choice["stop_reason"] = c.stop_reason if last else None
    if shape.vllm and not shape.req.stream:
        choice["prompt_logprobs"] = None
        choice["prompt_token_ids"] = prompt if shape.want_ids else None
        choice["token_ids"] = ids if shape.want_ids else None
    elif shape.want_ids:
        choice |= ({"prompt_token_ids": prompt} if prompt is not None else {}) | {"token_ids": ids}
    return choice


def _echoed(shape: Shape, prompt: list[int], text: str,
            logprobs: dict | None) -> tuple[str, dict | None]:
    """``echo``: vLLM puts the prompt before the answer, in the text and in the logprob
    entries (the first prompt token has no logprob: null)."""
    tokens = [shape.token_text(t) for t in prompt]
    text = "".join(tokens) + text
    if logprobs is None:
        return text, None
    values = [None, *(-0.5 for _ in prompt[1:])]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
    shift = sum(len(t) for t in tokens)
    return text, {
        "text_offset": offsets + [o + shift for o in logprobs["text_offset"]],
        "token_logprobs": values + logprobs["token_logprobs"],
        "tokens": tokens + logprobs["tokens"],
        "top_logprobs": [None, *({t: -0.5} for t in tokens[1:])] + logprobs["top_logprobs"],
    }


def completion_body(shape: Shape, results: list[tuple[list[int], Completion]], prompt_tokens: int):
    choices = [_text_choice(shape, i, c, c.events, p) for i, (p, c) in enumerate(results)]
    body = shape.envelope("text_completion", choices)
    body["usage"] = shape.usage(prompt_tokens, [c for _, c in results])
    return body


def completion_chunks(
    shape: Shape, results: list[tuple[list[int], Completion]], prompt_tokens: int
) -> Iterator[dict]:
    for step in range(max(len(c.events) for _, c in results)):
        for i, (p, c) in enumerate(results):
            if step < len(c.events):
                prompt = p if step == 0 else None
                choice = _text_choice(shape, i, c, c.events[step : step + 1], prompt)
                yield shape.envelope("text_completion", [choice])
    if shape.include_usage:
        yield shape.usage_chunk("text_completion", prompt_tokens, [c for _, c in results])
