"""Why a trajectory split: the messages a harness resent against the model's own reply.

``build_trajectories`` finds where a "non_prefix" row's prompt left the earlier context
it shares most with (a token position); ``explain`` reads the two calls' bodies to say
why, with a cause from ``exporters.history.CAUSES``: the earlier request's messages plus the
model's reply are what the harness was expected to resend, and the first message that
differs names the cause. Pure: the caller hands over the bodies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import msgspec

from tracetap.exporters.history import diff_excerpts, excerpt, history_cause
from tracetap.exporters.trajectories import Trajectory

_decode = msgspec.json.Decoder(dict).decode


class Bodies(Protocol):
    request: str | None
    upstream_request: str | None  # what the engine was given, when it differs
    response: str | None


def explain(row: Trajectory, calls: Mapping[str, Bodies]) -> None:
    """Fill ``row``'s drift cause, message index and text excerpts (it has a position)."""
    if row.drift_call_id is None or row.drift_cause is not None:
        return
    new, old = calls.get(row.split_call_id or row.call_ids[0]), calls.get(row.drift_call_id)
    if new is None or old is None:
        row.drift_cause = "unknown"
        return
    request, earlier = _request(new), _request(old)
    response = _json(old.response)
    if request is None or earlier is None or response is None:
        row.drift_cause = "unknown"
        return
    messages, earlier_messages = chat_messages(request), chat_messages(earlier)
    if messages is not None and earlier_messages is not None:
        _explain_messages(row, messages, earlier_messages, response)
    elif isinstance(request.get("prompt"), str) and isinstance(earlier.get("prompt"), str):
        text = _completion_text(response, row.drift_choice_index or 0)
        context, prompt = earlier["prompt"] + (text or ""), request["prompt"]
        row.drift_cause = "template_drift" if prompt.startswith(context) else "history_edited"
        row.drift_expected_text, row.drift_received_text = diff_excerpts(context, prompt)
    else:
        row.drift_cause = "unknown"


def _explain_messages(row: Trajectory, resent: Sequence[Mapping[str, Any]],
                      earlier: Sequence[Mapping[str, Any]], response: Mapping[str, Any]) -> None:
    reply = reply_message(response, row.drift_choice_index or 0)
    if reply is None:
        row.drift_cause = "unknown"
        return
    expected = [*earlier, reply]
    cause, index = history_cause(expected, resent, len(earlier))
    if cause == "template_drift" and _stop_string(response, row.drift_choice_index or 0):
        cause = "stop_string_cut"
    row.drift_cause, row.drift_message_index = cause, index
    row.drift_expected_text, row.drift_received_text = diff_excerpts(
        excerpt(_at(expected, index)), excerpt(_at(resent, index)))


def chat_messages(request: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    """A chat request's messages; a Responses request's ``instructions`` and ``input`` as
    the same messages (an assistant's text and its ``function_call`` items one message, as
    ``reply_message`` reads a reply); None for anything else."""
    if isinstance(request.get("messages"), list):
        return request["messages"]
    items = request.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        return None
    instructions = request.get("instructions")
    messages: list[dict[str, Any]] = []
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        if isinstance(item, Mapping):
            _add_item(messages, item)
    return messages


def _add_item(messages: list[dict[str, Any]], item: Mapping[str, Any]) -> None:
    kind = item.get("type", "message")
    last = messages[-1] if messages else None
    if kind == "function_call":
        if last is None or last.get("role") != "assistant":
            last = {"role": "assistant", "content": None}
            messages.append(last)
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
        last["tool_calls"] = [*last.get("tool_calls", ()), call]
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": item.get("output")})
    elif kind == "message":
        content = item.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping)
                              and p.get("type") in ("input_text", "output_text", "text"))
        messages.append({"role": item.get("role"), "content": content or None})
    elif kind != "reasoning":  # a reply's reasoning items are not read back either
        messages.append({"role": kind, "content": dict(item)})


def _stop_string(response: Mapping[str, Any], index: int) -> bool:
    """Whether the reply ended on a ``stop`` string (vLLM's ``stop_reason``, SGLang's
    ``matched_stop``): its token is in the completion ids but not in the text."""
    for choice in response.get("choices") or ():
        if isinstance(choice, Mapping) and choice.get("index", 0) == index:
            matched = choice.get("stop_reason", choice.get("matched_stop"))
            return isinstance(matched, str) and choice.get("finish_reason") == "stop"
    return False


def reply_message(response: Mapping[str, Any], index: int) -> dict[str, Any] | None:
    """The model's reply as a chat message, from a chat, Anthropic Messages or OpenAI
    Responses body (translated calls store the client's API)."""
    if isinstance(response.get("choices"), list):
        return _chat_reply(response["choices"], index)
    if response.get("type") == "message" and isinstance(response.get("content"), list):
        return _messages_reply(response["content"])
    if response.get("object") == "response" and isinstance(response.get("output"), list):
        return _responses_reply(response["output"])
    return None


def _chat_reply(choices: list, index: int) -> dict[str, Any] | None:
    for choice in choices:
        if isinstance(choice, Mapping) and choice.get("index", 0) == index:
            message = choice.get("message")
            return dict(message) if isinstance(message, Mapping) else None
    return None


def _messages_reply(content: list) -> dict[str, Any]:
    """An Anthropic Messages reply: text, tool_use and thinking blocks."""
    blocks = [b for b in content if isinstance(b, Mapping)]
    return _assistant("".join(b.get("text", "") for b in blocks if b.get("type") == "text"),
                      [(b.get("id"), b.get("name"), b.get("input", {}))
                       for b in blocks if b.get("type") == "tool_use"],
                      "".join(b.get("thinking", "") for b in blocks
                              if b.get("type") == "thinking"))


def _responses_reply(output: list) -> dict[str, Any]:
    """An OpenAI Responses reply: message items' text, function_call items."""
    items = [i for i in output if isinstance(i, Mapping)]
    text = "".join(part.get("text", "") for i in items if i.get("type") == "message"
                   for part in i.get("content") or () if isinstance(part, Mapping))
    return _assistant(text, [(i.get("call_id"), i.get("name"), i.get("arguments", ""))
                             for i in items if i.get("type") == "function_call"], "")


def _assistant(text: str, calls: Sequence[tuple], reasoning: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = [{"id": i, "type": "function",
                                  "function": {"name": n, "arguments": a}} for i, n, a in calls]
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def _completion_text(response: Mapping[str, Any], index: int) -> str | None:
    for choice in response.get("choices") or ():
        if isinstance(choice, Mapping) and choice.get("index", 0) == index:
            text = choice.get("text")
            return text if isinstance(text, str) else None
    return None


def _request(call: Bodies) -> dict[str, Any] | None:
    return _json(call.upstream_request or call.request)


def _json(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        return _decode(text)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _at(messages: Sequence[Any], index: int) -> Mapping[str, Any] | None:
    message = messages[index] if index < len(messages) else None
    return message if isinstance(message, Mapping) else None
