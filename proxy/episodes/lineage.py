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

Text is hashed, not JSON: a content block's ``cache_control`` (which Claude Code moves
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

_SYSTEM_ROLES = ("system", "developer")
_NAME_CHARS = 128  # calls.lineage
# A header line of ``key=value;`` pairs at the very start, then the end of its block or
# line. A value holds no ``=`` or ``;``: each pair parses one way (no backtracking blow-up
# on a long system prompt that almost matches).
_HEADER = re.compile(r"\Ax-[A-Za-z0-9-]{1,64}:(?:[ \t]*[\w.-]+=[^;=\n\x1f\x1e]*;)+[ \t]*"
                     r"(?:[\n\x1f\x1e]|\Z)")


def names(headers: Mapping[str, str]) -> tuple[str | None, str | None]:
    """The harness's (lineage, parent) names from the request headers."""
    return _name(headers.get(LINEAGE_HEADER)), _name(headers.get(PARENT_HEADER))


def conversation(payload: Mapping[str, Any]) -> str | None:
    """``S:F`` for a request with messages (chat, Anthropic Messages, Responses); None
    for one without (a completions prompt)."""
    messages = payload.get("messages")
    if messages is None:
        messages = payload.get("input")
    if isinstance(messages, str):  # Responses: the input as one user message
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, list):
        return None
    system = [_text(payload.get("system")), _text(payload.get("instructions"))]
    first = None
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        if message.get("role") in _SYSTEM_ROLES and first is None:
            system.append(_text(message.get("content")))
        elif first is None:
            first = _text(message.get("content", message))
            break
    start = _HEADER.sub("", "\x1e".join(s for s in system if s))
    return f"{_hash(start)}:{_hash(start + chr(0x1d) + (first or ''))}"


def _text(value: Any) -> str:
    """The text of a content value: a string, or the texts of its blocks joined (a
    block that is not text counts by its type)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        text = value.get("text")
        if isinstance(text, str):
            return text
        content = value.get("content")
        return _text(content) if content is not None else str(value.get("type", ""))
    if isinstance(value, list):
        return "\x1f".join(_text(v) for v in value)
    return str(value)


def _hash(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=8).hexdigest()


def _name(value: str | None) -> str | None:
    value = (value or "").strip()
    return value[:_NAME_CHARS] or None
