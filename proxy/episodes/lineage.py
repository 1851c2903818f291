"""What a call says about the conversation it belongs to inside its episode.

A coding CLI's episode holds several conversations: the main agent, its sub-agents, a
title generator, a summariser. The export groups calls into *lineages*
(``exporters.lineages``) from two things captured here:

- the harness's own names, when it sends them: ``X-Tracetap-Lineage: NAME`` (the
  conversation) and ``X-Tracetap-Parent: NAME`` (the one that started it); removed
  before the request goes upstream, like every tracetap header;
- ``conversation``: two short hashes of the request's start, ``S:F``: S of its system
  prompt, F of its system prompt and first non-system message. Every turn of one
  conversation resends the same start, so its calls share F; a conversation that
  rewrote its history (a summary in place of the old turns) keeps S.

The request is read by its API's reader (``storage.conversation``). Text is hashed, not
JSON: a content block's ``cache_control`` (which Claude Code moves
from turn to turn) and other markup do not change the hash. Nor does a header line that a
harness puts at the very start of its system prompt, ``x-NAME: key=value; key=value;``
(Claude Code 2.1: ``x-anthropic-billing-header: cc_version=...; cc_entrypoint=...;``):
its values change with the build and the session (at ``/compact`` among others), not
with the conversation.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

from tracetap.proxy.http.headers import LINEAGE_HEADER, PARENT_HEADER
from tracetap.storage.conversation import (
    SYSTEM_ROLES,
    Message,
    Other,
    Part,
    Reader,
    Text,
    ToolResult,
)

_NAME_CHARS = 128  # calls.lineage
_FIRST = 8  # messages read first: a system prompt or two, and the first turn
# A header line of ``key=value;`` pairs at the very start, then the end of its block or
# line. A value holds no ``=`` or ``;``: each pair parses one way (no backtracking blow-up
# on a long system prompt that almost matches).
_HEADER = re.compile(r"\Ax-[A-Za-z0-9-]{1,64}:(?:[ \t]*[\w.-]+=[^;=\n\x1f\x1e]*;)+[ \t]*"
                     r"(?:[\n\x1f\x1e]|\Z)")


def names(headers: Mapping[str, str]) -> tuple[str | None, str | None]:
    """The harness's (lineage, parent) names from the request headers."""
    return _name(headers.get(LINEAGE_HEADER)), _name(headers.get(PARENT_HEADER))


def conversation(reader: Reader, payload: Mapping[str, Any]) -> str | None:
    """``S:F`` for a request with messages (read by its API's reader: chat, Anthropic
    Messages, Responses); None for one without (a completions prompt)."""
    messages = _start(reader, payload)
    if messages is None:
        return None
    system = []
    first = None
    for message in messages:
        if message.role == "other":  # not a message (not an object): no part of the start
            continue
        if message.role in SYSTEM_ROLES:
            system.append(_text(message.parts))
        else:
            first = _text(message.parts)
            break
    start = _HEADER.sub("", "\x1e".join(s for s in system if s))
    return f"{_hash(start)}:{_hash(start + chr(0x1d) + (first or ''))}"


def _start(reader: Reader, payload: Mapping[str, Any]) -> list[Message] | None:
    """The request's messages up to its first one that is not the system prompt: read a
    few at a time, as a long conversation's start is all the hash reads."""
    wanted = _FIRST
    while True:
        messages = reader(payload, {}, first=wanted).messages
        if messages is None or len(messages) < wanted or any(
                m.role not in SYSTEM_ROLES and m.role != "other" for m in messages):
            return messages
        wanted *= 8


def _text(parts: list[Part] | None) -> str:
    """The text of a message's parts joined (a part that is not text counts by its type;
    a tool result by its content)."""
    return "\x1f".join(_part(p) for p in parts or ())


def _part(part: Part) -> str:
    if type(part) is Text:
        return part.text
    if type(part) is ToolResult and part.parts is not None:
        return _text(part.parts)
    if type(part) is Other and isinstance(part.value, str):
        return part.value
    return part.block


def _hash(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=8).hexdigest()


def _name(value: str | None) -> str | None:
    value = (value or "").strip()
    return value[:_NAME_CHARS] or None
