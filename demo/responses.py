"""OpenAI Responses API (``POST /v1/responses``) of the mock engine, shaped like vLLM's.

A request is first rendered as the equivalent chat conversation (``to_chat``), so it gets
the same prompt ids, tokens and logprobs as that chat-completions request. The mapping,
which a translating proxy must reproduce to compare token for token:

- ``instructions`` → a leading ``system`` message; a string ``input`` → one ``user`` message.
- message items → ``{"role", "content"}`` with the text of their parts joined
  (``input_text`` / ``output_text``); an assistant message or ``function_call`` right after
  an assistant message merges into it (content, then ``tool_calls``), like vLLM.
- ``function_call`` → an assistant ``tool_calls`` entry ``{"id": call_id, "type":
  "function", "function": {"name", "arguments"}}``; ``function_call_output`` →
  ``{"role": "tool", "tool_call_id": call_id, "content": output}``; ``reasoning`` items
  are dropped (the mock does not reason).
- tools of ``type: function`` → ``{"type": "function", "function": <the tool minus
  "type">}``; other tool types are ignored. ``tool_choice`` ``{"type": "function", "name"}``
  → ``{"type": "function", "function": {"name"}}``.

Unlike vLLM, the prompt has no second BOS (the byte vocabulary has none), so
``usage.input_tokens`` equals the chat prompt length.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from tracetap.demo import tokenizer as tok
from tracetap.demo.generate import Completion, logprob_rows
from tracetap.demo.wire import ChatTurn, EngineRequest, InputError, Shape

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_ROLES = ("user", "assistant", "system", "developer")
# What OpenAI's own /v1/responses accepts (the ``openai`` flavor rejects anything else).
# fmt: off
OPENAI_FIELDS = frozenset({
    "background", "conversation", "include", "input", "instructions", "max_output_tokens",
    "max_tool_calls", "metadata", "model", "parallel_tool_calls", "previous_response_id",
    "prompt", "prompt_cache_key", "reasoning", "safety_identifier", "service_tier", "store",
    "stream", "stream_options", "temperature", "text", "tool_choice", "tools", "top_logprobs",
    "top_p", "truncation", "user",
})
# fmt: on


class ResponsesRequest(EngineRequest, kw_only=True):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    top_logprobs: int | None = None
    include: list[str] | None = None
    enable_response_messages: bool = False  # vLLM's way to return prompt and output ids
    previous_response_id: str | None = None
    # Echoed back as sent, like vLLM does (``store`` and the rest are ignored).
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    truncation: str = "disabled"
    user: str | None = None
    service_tier: str = "auto"


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):  # content parts: text, and images as placeholders
        return "".join(map(tok.part_text, content))
    raise InputError("content must be a string or a list of parts", "input")


def _input_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise InputError(f"input[{i}] must be an object", "input")
        kind = item.get("type", "message")
        prev = out[-1] if out and out[-1]["role"] == "assistant" else None
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise InputError(f"input[{i}].role must be one of {', '.join(_ROLES)}", "input")
            text = _text(item.get("content"))
            if role == "assistant" and prev is not None and prev.get("content") is None:
                prev["content"] = text
            else:
                out.append({"role": role, "content": text})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
                raise InputError(f"input[{i}]: a function_call needs name and arguments", "input")
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments")}
            if prev is not None:
                prev.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text(item.get("output"))
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind != "reasoning":
            raise InputError(f"input[{i}]: items of type {kind!r} are not supported", "input")
    return out


def _tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice if isinstance(choice, str) else "auto"


def to_chat(req: ResponsesRequest) -> ChatTurn:
    if req.previous_response_id is not None:
        raise InputError("previous_response_id needs a response store; the mock keeps none",
                         "previous_response_id")
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        messages = [*system, {"role": "user", "content": req.input}]
    else:
        messages = [*system, *_input_messages(req.input)]
    if not messages:
        raise InputError("input must not be empty", "input")
    tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
        for t in req.tools or ()
        if t.get("type") == "function"
    ]
    return ChatTurn(messages, tools or None, _tool_choice(req.tool_choice))


def top_k(req: ResponsesRequest) -> int | None:
    """Logprobs only when ``include`` asks for them, as in vLLM; ``top_logprobs`` sets k."""
    return (req.top_logprobs or 0) if LOGPROBS_INCLUDE in (req.include or ()) else None


# ---- bodies ----------------------------------------------------------------------------


def _logprobs(c: Completion, ids: list[int], start: int, k: int, with_bytes: bool) -> list:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        out: dict[str, Any] = {"token": tok.token_str(token_id)}
        if with_bytes:
            out["bytes"] = list(tok.token_bytes(token_id))
        return out | {"logprob": logprob}

    rows = logprob_rows(c.key, ids, start, k)
    return [
        entry(t, row.logprob) | {"top_logprobs": [entry(a, lp) for a, lp in row.top]}
        for t, row in zip(ids, rows)
    ]


def _output(shape: Shape, c: Completion) -> list[dict[str, Any]]:
    """The output items: the text as one message, then one ``function_call`` per call."""
    suffix, items = shape.id.removeprefix("resp_"), []
    if c.content:
        logprobs = None
        if shape.top_k is not None:  # every completion token, as the chat path reports them
            logprobs = _logprobs(c, c.token_ids, 0, shape.top_k, with_bytes=True)
        part = {"type": "output_text", "text": c.content, "annotations": [], "logprobs": logprobs}
        items.append({"id": f"msg_{suffix}", "type": "message", "role": "assistant"} | {
            "status": "completed", "content": [part]
        })
    for i, call in enumerate(c.tool_calls):
        function = call["function"]
        items.append({"id": f"fc_{suffix}_{i}", "type": "function_call", "status": "completed"} | {
            "call_id": call["id"], "name": function["name"], "arguments": function["arguments"]
        })
    return items


def _raw(text: str, ids: list[int]) -> list[dict[str, Any]]:
    return [{"message": text, "tokens": ids, "type": "raw_message_tokens"}]


def response_body(shape: Shape, prompt_ids: list[int], c: Completion, max_tokens: int) -> dict:
    req = shape.req
    assert isinstance(req, ResponsesRequest)
    incomplete = c.finish_reason == "length"
    body = {"id": shape.id, "object": "response", "created_at": shape.created, "model": shape.model}
    body |= {"status": "incomplete" if incomplete else "completed"}
    body["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
    body |= {"instructions": req.instructions, "metadata": req.metadata}
    body["output"] = _output(shape, c)
    body |= {"parallel_tool_calls": req.parallel_tool_calls, "tool_choice": req.tool_choice}
    body["tools"] = req.tools or []
    body["temperature"] = 1.0 if req.temperature is None else req.temperature
    body["top_p"] = 1.0 if req.top_p is None else req.top_p
    body |= {"background": False, "max_output_tokens": max_tokens, "max_tool_calls": None}
    body |= {"previous_response_id": None, "prompt": None, "reasoning": req.reasoning}
    body |= {"service_tier": req.service_tier, "text": req.text, "top_logprobs": shape.top_k}
    body |= {"truncation": req.truncation, "user": req.user}
    out = len(c.token_ids)
    body["usage"] = {
        "input_tokens": len(prompt_ids),
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": len(prompt_ids) + out,
    }
    ids = shape.vllm and req.enable_response_messages
    body["input_messages"] = _raw(tok.decode(prompt_ids), prompt_ids) if ids else None
    body["output_messages"] = _raw(tok.decode(c.token_ids), c.token_ids) if ids else None
    return body


# ---- stream ----------------------------------------------------------------------------


def _text_events(shape: Shape, c: Completion, index: int, item: dict) -> Iterator[dict]:
    """A message item: text deltas with their tokens' logprobs (no ``bytes``), then the
    done events; ``output_text.done`` has empty logprobs and the later ones the full list."""
    where = {"item_id": item["id"], "output_index": index}
    part = item["content"][0]
    yield {"type": "response.output_item.added", "output_index": index, "item": item | {
        "status": "in_progress", "content": []
    }}
    yield {"type": "response.content_part.added", **where, "content_index": 0, "part": part | {
        "text": "", "logprobs": []
    }}
    for event in c.events:
        if event.kind != "content" or not event.text:  # vLLM sends no empty deltas either
            continue
        logprobs = [] if shape.top_k is None else _logprobs(
            c, event.ids, event.start, shape.top_k, with_bytes=False
        )
        yield {"type": "response.output_text.delta", **where, "content_index": 0} | {
            "delta": event.text, "logprobs": logprobs
        }
    yield {"type": "response.output_text.done", **where, "content_index": 0} | {
        "text": part["text"], "logprobs": []
    }
    yield {"type": "response.content_part.done", **where, "content_index": 0, "part": part}
    yield {"type": "response.output_item.done", "output_index": index, "item": item}


def _call_events(c: Completion, index: int, call: int, item: dict) -> Iterator[dict]:
    where = {"item_id": item["id"], "output_index": index}
    yield {"type": "response.output_item.added", "output_index": index, "item": item | {
        "status": "in_progress", "arguments": ""
    }}
    for event in c.events:
        if event.kind == "tool_args" and event.tool_index == call:
            yield {"type": "response.function_call_arguments.delta", **where, "delta": event.text}
    yield {"type": "response.function_call_arguments.done", **where} | {
        "name": item["name"], "arguments": item["arguments"]
    }
    yield {"type": "response.output_item.done", "output_index": index, "item": item}


def response_events(shape: Shape, body: dict, c: Completion) -> Iterator[dict]:
    """vLLM's event sequence; ``response.completed`` carries ``body`` itself, ids included."""

    def events() -> Iterator[dict]:
        opening = body | {"status": "in_progress", "incomplete_details": None, "output": []}
        opening |= {"usage": None, "input_messages": None, "output_messages": None}
        yield {"type": "response.created", "response": opening}
        yield {"type": "response.in_progress", "response": opening}
        calls = 0
        for index, item in enumerate(body["output"]):
            if item["type"] == "message":
                yield from _text_events(shape, c, index, item)
            else:
                yield from _call_events(c, index, calls, item)
                calls += 1
        yield {"type": "response.completed", "response": body}

    for number, event in enumerate(events()):
        yield event | {"sequence_number": number}
