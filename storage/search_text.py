"""What of a call the viewer's search indexes: the turn it adds, not the history it resends.

A harness resends its whole conversation on every call, so indexing each request whole
would index a 200-call episode's first message 200 times (quadratic text). A call's text
is instead: the request's messages from its last assistant message on (that message, the
tool results and user messages since: what the harness added this turn; all of them when
no assistant has spoken yet, with the set-up before them: a system prompt), each choice's
text, and the error (with the upstream's answer when it was an error: its message is
there). Where the messages and the set-up are, and what an assistant message looks like,
is the API's ``Shape`` (storage.conversation; handed in by whoever composes the writer,
prune and the viewer): a request of an API without one is indexed whole.
The message list is decoded as raw slices and only its tail is parsed, so the writer's
cost stays a fraction of the JSON decode of the body (bench/writer_bench.py).

What is missed: a message the harness rewrote earlier in its history (a summarised
context) is indexed only where it first appears after an assistant turn.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import msgspec

from tracetap.storage.conversation import Readers, Shape
from tracetap.storage.records import CallRecord

MAX_CHARS = 100_000  # per call: a 10 MB tool output is searchable by its start
ERROR_BODY = 4_000  # characters of an upstream's error answer
# Strings under these keys are text a person reads; everything beneath them is too
# (an Anthropic tool_use ``input`` object, a Responses ``output`` list).
TEXT_KEYS = frozenset({"content", "text", "arguments", "output", "input", "prompt", "system",
                       "instructions", "refusal", "reasoning_content", "thinking"})
SKIP_KEYS = frozenset({"logprobs", "top_logprobs", "usage", "image_url", "source", "data",
                       "signature", "encrypted_content", "id", "tool_call_id", "call_id",
                       "type", "role", "cache_control"})
_ABSENT = msgspec.Raw()  # msgspec.Raw cannot be part of a union: empty means absent


class _Role(msgspec.Struct):
    role: Any = None
    type: Any = None


_role = msgspec.json.Decoder(_Role)
_any = msgspec.json.Decoder()


def call_text(record: CallRecord, readers: Readers) -> str:
    """The searchable text of one call ('' when it has none), at most MAX_CHARS;
    ``readers``: where each API's requests hold their messages (its endpoint's shape)."""
    return text_of(record.request, readers.shape(record.endpoint),
                   [c.text for c in record.choices],
                   failure(record.error, record.http_status, record.response))


def failure(error: str | None, http_status: int, response: str | None) -> str | None:
    """The error, and for an upstream's error answer its body (its message is there)."""
    if http_status == 200 or not response:
        return error
    return "\n".join(filter(None, (error, response[:ERROR_BODY])))


def text_of(request: str | None, shape: Shape, choice_texts: Iterable[str | None],
            error: str | None) -> str:
    """call_text from a call's stored parts (search_recompute reads them so);
    ``error``: the error text, with a failed call's response (``failure``)."""
    parts: list[str] = []
    if request:
        try:
            _request_parts(request, shape, parts)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            pass  # not JSON (or not an object): its text is still in the call page
    parts.extend(t for t in choice_texts if t)
    if error:
        parts.append(error)
    text = "\n".join(parts)[:MAX_CHARS]
    # Only words are searched: a NUL or a lone surrogate (JSON can escape both), which a
    # Postgres text column refuses, must not make the database refuse the whole record.
    return text.replace("\x00", " ").encode("utf-8", "replace").decode("utf-8")


@functools.cache
def _decoders(shape: Shape) -> tuple[msgspec.json.Decoder, msgspec.json.Decoder]:
    """Decoders of a request of ``shape`` into raw slices (fields named by position,
    renamed to the shape's keys): its messages as a list of raw elements; and, for a
    text in the list's place (a Responses ``input``), as one raw value."""
    def decoder(listed: bool) -> msgspec.json.Decoder:
        fields: list[tuple] = [(f"h{i}", msgspec.Raw, _ABSENT) for i in range(len(shape.head))]
        rename = {f"h{i}": key for i, key in enumerate(shape.head)}
        if shape.messages is not None:
            fields.append(("m", list[msgspec.Raw] | None, None) if listed
                          else ("m", msgspec.Raw, _ABSENT))
            rename["m"] = shape.messages
        if shape.prompt is not None:
            fields.append(("p", msgspec.Raw, _ABSENT))
            rename["p"] = shape.prompt
        return msgspec.json.Decoder(msgspec.defstruct("Request", fields, rename=rename))
    return decoder(True), decoder(False)


def _request_parts(request: str, shape: Shape, parts: list[str]) -> None:
    if shape.messages is None and shape.prompt is None:  # an API without a shape
        _strings(_any.decode(request), parts, False)  # the whole request, resent or not
        return
    listed, whole = _decoders(shape)
    try:
        found, text = listed.decode(request), _ABSENT
        items = getattr(found, "m", None)
    except msgspec.ValidationError:  # not a list where the messages go: a text (or not)
        found = whole.decode(request)
        text, items = getattr(found, "m", _ABSENT), None
    if items is None:
        for raw in (text, getattr(found, "p", _ABSENT)):
            if raw:
                value = _any.decode(raw)
                if isinstance(value, list):
                    items = [msgspec.json.encode(v) for v in value]  # small: rare shape
                else:
                    _strings(value, parts, True)
                break
    tail = _tail(items or [], shape)
    if len(tail) == len(items or []):  # nobody answered yet: the set-up is new too
        for i in range(len(shape.head)):
            raw = getattr(found, f"h{i}")
            if raw:
                _strings(_any.decode(raw), parts, True)
    for raw in tail:
        _strings(_any.decode(raw), parts, False)


def _tail(items: list, shape: Shape) -> list:
    """The items from the last assistant one on (all when there is none)."""
    roles, types = shape.assistant_roles, shape.assistant_types
    for at in range(len(items) - 1, -1, -1):
        try:
            probe = _role.decode(items[at])
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if probe.role in roles or probe.type in types:
            return items[at:]
    return items


def _strings(value: Any, parts: list[str], inside: bool, depth: int = 0) -> None:
    """Append the text strings in ``value``: those under TEXT_KEYS, and below them."""
    if depth > 32:
        return
    if isinstance(value, str):
        if inside and value:
            parts.append(value)
    elif isinstance(value, list):
        for v in value:
            _strings(v, parts, inside, depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            if k not in SKIP_KEYS:
                _strings(v, parts, inside or k in TEXT_KEYS, depth + 1)
