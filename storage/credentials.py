"""Credentials hidden wherever the viewer shows or serves a stored body: one rule.

A value is a credential when its key names one (``KEY``: ``api_key``, ``password``,
``Authorization``, ``access_token``, ``client_secret``...; a logprob's ``token`` and a
count's ``max_tokens`` are not). Bodies are the agent's: a tool call's ``arguments`` is a
JSON string inside the JSON body, and a string may hold JSON escaped once more, so each
string that looks like JSON is decoded to a fixed point (until it is no longer a JSON
string) before its keys are checked, and encoded back as deep as it was. Text that is not
JSON (a tool's output, a search snippet) is read for ``key: value`` and ``key=value``
under the same names (``TEXT_KEY``), quoted or escaped as JSON writes them.

Only what the viewer reads goes through here: the stored rows keep what was sent (the
export is the trainer's exact data).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

HIDDEN = "(hidden: a credential is never shown)"
_NAMES = (r"authorization|proxy-authorization|cookie|set-cookie|bearer|credentials?|"
          r"[\w-]*api[-_]?key|[\w-]*passw(?:or)?d|[\w-]*secret(?:[-_]?(?:access[-_]?)?key)?|"
          r"private[-_]?key|(?:[\w-]*[-_])?(?:access|refresh|auth|session|id|oauth|bearer|"
          r"github|gh|csrf|secret|api)[-_]?token")
KEY = re.compile(rf"^(?:{_NAMES})$", re.IGNORECASE)
# In text: the name as a whole word, quoted or not (a backslash per level of escaping), a
# colon or an equals sign, then a quoted value (to its closing quote, same escaping) or a
# bare one (to a space, comma, semicolon, ampersand, quote or bracket; "Bearer x" whole).
TEXT_KEY = re.compile(
    rf"(?P<q>\\*[\"']?)(?<![\w-])(?P<key>{_NAMES})(?![\w-])(?P=q)\s*[:=]\s*"
    r"(?:(?P<vq>\\*[\"'])(?P<quoted>[^\n]*?)(?<!\\)(?P=vq)"
    r"|(?P<bare>(?:(?:Bearer|Basic|Token)\s+)?[^\s,;&\"'}\]\\]+))", re.IGNORECASE)
# A cheap test before the regex (which costs ~0.4 ms per 1,000 characters): a credential
# name ends in one of these, followed by the rest of a word, a quote and ':' or '='.
_HINTS = ("key", "pass", "secret", "token", "auth", "cookie", "credential")
_AFTER = re.compile(r"[\w-]*\\*[\"']?\s*[:=]")
_SPACE = re.compile(r"\s*")
_DEPTH = 64  # levels walked: deeper JSON is shown as text by the viewer anyway
_LEVELS = 8  # times a string is decoded as JSON before it is taken as text


def mask_text(text: str) -> str:
    """Free text with the values after credential names replaced by HIDDEN."""
    if not _may_hold(text.lower()):
        return text
    return TEXT_KEY.sub(_hide_match, text)


def _may_hold(lower: str) -> bool:
    for hint in _HINTS:
        at = lower.find(hint)
        while at != -1:
            if _AFTER.match(lower, at + len(hint)):
                return True
            at = lower.find(hint, at + len(hint))
    return False


def _hide_match(m: re.Match) -> str:
    head = m.group(0)[:m.start("quoted" if m.group("vq") else "bare") - m.start(0)]
    tail = m.group("vq") or ""
    return head + HIDDEN + tail


def mask_body(body: str | None) -> str | None:
    """A stored body with its credentials hidden: as it was when it holds none (byte for
    byte), else the masked JSON (or text, when it is not JSON)."""
    if not body:
        return body
    try:
        value = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return mask_text(body)
    masked, changed = mask_value(value)
    return msgspec.json.encode(masked).decode() if changed else body


def mask_value(value: Any, depth: int = 0) -> tuple[Any, bool]:
    """(the value with credentials hidden, whether anything was)."""
    if depth > _DEPTH:
        return value, False
    if isinstance(value, dict):
        out, changed = {}, False
        for k, v in value.items():
            if isinstance(k, str) and KEY.match(k) and v not in (None, ""):
                out[k], changed = HIDDEN, True
            else:
                out[k], hit = mask_value(v, depth + 1)
                changed = changed or hit
        return (out, True) if changed else (value, False)
    if isinstance(value, list):
        pairs = [mask_value(v, depth + 1) for v in value]
        if any(hit for _, hit in pairs):
            return [v for v, _ in pairs], True
        return value, False
    if isinstance(value, str):
        masked = mask_string(value, depth)
        return masked, masked is not value
    return value, False


def _json_like(text: str) -> bool:
    start = _SPACE.match(text).end()
    return text[start:start + 1] in ("{", "[", '"')


def mask_string(text: str, depth: int = 0) -> str:
    """A string, decoded as JSON to a fixed point when it is JSON (a tool call's
    arguments), masked, and encoded back as many times; else masked as text. The same
    object when nothing was hidden."""
    levels, value = 0, text
    while isinstance(value, str) and levels < _LEVELS and _json_like(value):
        try:
            value = msgspec.json.decode(value)
        except (msgspec.DecodeError, RecursionError):
            break
        levels += 1
    if levels == 0 or isinstance(value, str):
        hidden = mask_text(value)
        if hidden == value:
            return text
        value = hidden
    else:
        value, changed = mask_value(value, depth + 1)
        if not changed:
            return text
    for _ in range(levels):
        value = msgspec.json.encode(value).decode()
    return value
