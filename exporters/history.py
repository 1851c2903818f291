"""What a harness resent compared with the model's own earlier turn (chat messages).

Pure functions on chat-completions messages, shared by drift explanation at export
(``exporters.drift``) and opt-in history repair in the proxy (``proxy.episodes.repair``); here
because the proxy may import the exporters and not the other way (docs/architecture.md).

An assistant message is compared as a ``Turn``: its text (a string, or text parts joined),
whether it came as parts, its tool calls (name, arguments as sent, and the arguments as a
JSON value), their ids and its reasoning. Two turns are **equal after normalisation** when
they differ only in ways that do not change what the model said:

- tool-call arguments that are equal as JSON values (``{"a":1}`` vs ``{"a": 1}``; key
  order; but ``1`` and ``1.0`` and ``true`` stay different);
- whitespace at the start and end of the text;
- text given as a list of text parts instead of a string;
- tool calls turned into text after the turn's own text: ``Calling tools:`` (optional)
  followed by a JSON or Python literal list (or one object) of calls, each ``{"name",
  "arguments"}`` or ``{"function": {"name", "arguments"}}``, equal as values.

Reasoning must be the same on both sides and tool-call ids equal where both have one.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

# Why a harness's resent history no longer extends the model's earlier context, checked
# in this order at the first message that differs (see docs/fidelity.md).
CAUSES = (
    "content_parts",           # the turn's text came back as text parts
    "tool_calls_as_text",      # its tool calls came back as text, not tool_calls
    "whitespace_changed",      # its text differs only in surrounding whitespace
    "tool_args_reserialized",  # its tool arguments equal as JSON, spelled differently
    "reasoning_stripped",      # its reasoning was left out, nothing else changed
    "assistant_turn_edited",   # the turn says something else
    "assistant_turn_dropped",  # the turn is not there
    "history_compacted",       # fewer earlier messages: summarised or truncated
    "history_edited",          # an earlier non-assistant message changed
    "system_changed",          # the system message changed (or a new conversation)
    "stop_string_cut",         # the messages agree; the reply ended on a stop string
    "template_drift",          # the messages agree; the engine's tokens do not
    "no_earlier_turn",         # no earlier call had finished when this one started
    "unknown",                 # no messages to compare (bodies missing, not chat)
)
# Equal after normalisation: what history repair may undo.
REPAIRABLE = frozenset({"content_parts", "tool_calls_as_text", "whitespace_changed",
                        "tool_args_reserialized"})
_LABEL = "Calling tools:"


class Call(NamedTuple):
    id: str | None
    name: str
    arguments: str | None  # as sent; None when only the value is known
    value: str | None  # canonical JSON of the parsed arguments; None if not JSON


class Turn(NamedTuple):
    text: str
    parts: bool
    calls: tuple[Call, ...]
    reasoning: str | None


def canonical(value: Any) -> str:
    """One spelling per JSON value: sorted keys, no spaces, 1 and 1.0 kept apart."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _value(arguments: Any) -> str | None:
    if not isinstance(arguments, str):
        return canonical(arguments)
    try:
        return canonical(json.loads(arguments))
    except ValueError:
        return None


def text_of(content: Any) -> tuple[str, bool]:
    """A message's text and whether it came as a list of parts."""
    if isinstance(content, str):
        return content, False
    if isinstance(content, Sequence) and not isinstance(content, bytes | str):
        texts = [p.get("text", "") for p in content if isinstance(p, Mapping)
                 and p.get("type", "text") == "text" and isinstance(p.get("text", ""), str)]
        return "".join(texts), True
    return "", False


def turn(message: Mapping[str, Any]) -> Turn:
    text, parts = text_of(message.get("content"))
    calls = []
    for call in message.get("tool_calls") or ():
        if not isinstance(call, Mapping):
            continue
        function = call.get("function") or {}
        arguments = function.get("arguments")
        calls.append(Call(call.get("id"), str(function.get("name") or ""),
                          arguments if isinstance(arguments, str) else None, _value(arguments)))
    reasoning = message.get("reasoning_content") or message.get("reasoning") or None
    return Turn(text, parts, tuple(calls), reasoning if isinstance(reasoning, str) else None)


def _calls_in_text(text: str) -> tuple[Call, ...] | None:
    """Tool calls written out as text (see the module doc), or None if it is not that."""
    text = text.strip()
    if text.startswith(_LABEL):
        text = text[len(_LABEL):].strip()
    if not text:
        return None
    try:
        listed = json.loads(text)
    except ValueError:
        try:
            listed = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return None
    listed = [listed] if isinstance(listed, Mapping) else listed
    if not isinstance(listed, list) or not listed:
        return None
    calls = []
    for item in listed:
        if not isinstance(item, Mapping):
            return None
        function = item.get("function", item)
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            return None
        value = _value(function.get("arguments", {}))
        if value is None:
            return None
        calls.append(Call(item.get("id"), function["name"], None, value))
    return tuple(calls)


def _same_values(a: Sequence[Call], b: Sequence[Call]) -> bool:
    return len(a) == len(b) and all(
        x.name == y.name and x.value is not None and x.value == y.value
        and (x.id is None or y.id is None or x.id == y.id) for x, y in zip(a, b))


def _text_calls(original: Turn, resent: Turn) -> bool:
    """The resent text is the original's text followed by its tool calls written out."""
    if not original.calls or resent.calls:
        return False
    head = original.text.strip()
    body = resent.text.strip()
    if not body.startswith(head):
        return False
    written = _calls_in_text(body[len(head):])
    return written is not None and _same_values(original.calls, written)


def equivalent(original: Turn, resent: Turn) -> bool:
    """Equal after normalisation (the module doc's rules)."""
    if original.reasoning != resent.reasoning:
        return False
    if _text_calls(original, resent):
        return True
    return (original.text.strip() == resent.text.strip()
            and _same_values(original.calls, resent.calls))


def identical(original: Turn, resent: Turn) -> bool:
    """What a template renders is the same: text, parts or not, arguments as spelled."""
    return (original.text == resent.text and original.parts == resent.parts
            and original.reasoning == resent.reasoning
            and len(original.calls) == len(resent.calls)
            and all(x.name == y.name and x.id == y.id and _same_spelling(x, y)
                    for x, y in zip(original.calls, resent.calls)))


def _same_spelling(x: Call, y: Call) -> bool:
    """Arguments spelled alike; when one side only has the value (an object was sent, or
    a translated reply), equal values are all that can be asked."""
    if x.arguments is None or y.arguments is None:
        return x.value is not None and x.value == y.value
    return x.arguments == y.arguments


def turn_cause(original: Turn, resent: Turn) -> str | None:
    """Why ``resent`` is not the model's ``original`` turn; None if it is identical."""
    if identical(original, resent):
        return None
    if equivalent(original, resent):
        if resent.parts and not original.parts:
            return "content_parts"
        if original.calls and not resent.calls:
            return "tool_calls_as_text"
        if original.text != resent.text:
            return "whitespace_changed"
        return "tool_args_reserialized"
    if original.reasoning and not resent.reasoning and equivalent(
            original._replace(reasoning=None), resent):
        return "reasoning_stripped"
    return "assistant_turn_edited"


def _plain(message: Mapping[str, Any]) -> tuple:
    """A non-assistant message as a template sees it."""
    text, parts = text_of(message.get("content"))
    return (message.get("role"), text, parts, message.get("tool_call_id"), message.get("name"))


def history_cause(expected: Sequence[Mapping], resent: Sequence[Mapping],
                  reply_index: int) -> tuple[str, int]:
    """Why ``resent`` does not extend ``expected`` (the earlier request's messages, then the
    model's reply at ``reply_index``): the cause and the index of the first message that
    differs (``template_drift`` when none does)."""
    for i, want in enumerate(expected):
        if i >= len(resent):
            return ("assistant_turn_dropped" if i == reply_index else "history_compacted"), i
        got = resent[i]
        if want.get("role") == "assistant" and got.get("role") == "assistant":
            cause = turn_cause(turn(want), turn(got))
            if cause is not None:
                return cause, i
            continue
        if _plain(want) == _plain(got):
            continue
        if i == reply_index:
            return "assistant_turn_dropped", i
        if i == 0 and "system" in (want.get("role"), got.get("role")):
            return "system_changed", i
        if len(resent) < len(expected):
            return "history_compacted", i
        return "history_edited", i
    return "template_drift", len(expected)


def excerpt(message: Mapping[str, Any] | None) -> str:
    """A message flattened for a short diff: its text, then its calls as name(arguments)."""
    if message is None:
        return ""
    t = turn(message)
    calls = "".join(f"{c.name}({c.arguments if c.arguments is not None else c.value})"
                    for c in t.calls)
    return t.text + calls


def diff_excerpts(expected: str, received: str, width: int = 40) -> tuple[str, str]:
    """The two strings from a little before their first difference, ``width`` long."""
    at = next((i for i, (a, b) in enumerate(zip(expected, received)) if a != b),
              min(len(expected), len(received)))
    start = max(0, at - 8)
    return expected[start:start + width], received[start:start + width]
