"""Cut a chat chunk's ``prompt_token_ids`` out by its bytes, to decode them later.

vLLM (asked for ``return_token_ids``) puts the whole prompt's ids in the first stream
chunk: at 60k context, ~430 KB of JSON in front of the first token. Decoding them into
Python ints takes milliseconds the agent would wait for. ``cut_prompt_ids`` finds the
member by scanning bytes (a few memchr-speed searches, no decoding), and returns the
chunk without it, which is what the client gets and what capture decodes, and the
array's bytes, which capture decodes once the first token is on its way.

Only the plain case is cut: a top-level member spelled exactly ``"prompt_token_ids"``
whose value is an array holding no string, array or object (so its first ``]`` is its
end). Anything else (``null``, an escaped key, a nested member, a deeper value) returns
None and the chunk is read whole, as before.
"""

from __future__ import annotations

import re

import msgspec

KEY = b'"prompt_token_ids"'
_WHITESPACE = b" \t\r\n"
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_MAX_PREFIX = 64 << 10  # a longer head before the key: read the chunk whole

decode_ids = msgspec.json.Decoder(list[int]).decode


def cut_prompt_ids(data: bytes) -> tuple[bytes, bytes] | None:
    """``(data without its top-level prompt_token_ids member, the member's array)``, or
    None when the member is absent or not in the plain shape."""
    return cut_member(data, KEY)


def cut_member(data: bytes, name: bytes) -> tuple[bytes, bytes] | None:
    """``cut_prompt_ids`` for the member spelled ``name`` (its quotes included), e.g. a
    /tokenize answer's ``"tokens"``."""
    key = data.find(name)
    while key >= 0:
        cut = _cut_at(data, key, len(name))
        if cut is not None:
            return cut
        key = data.find(name, key + len(name))  # that one was nested: a later one may not be
    return None


def _cut_at(data: bytes, key: int, size: int) -> tuple[bytes, bytes] | None:
    at = _skip(data, key + size)
    if data[at : at + 1] != b":":
        return None
    start = _skip(data, at + 1)
    if data[start : start + 1] != b"[":
        return None
    end = data.find(b"]", start)
    if end < 0 or _holds_values(data, start + 1, end):
        return None
    end += 1
    before = key - 1
    while before >= 0 and data[before] in _WHITESPACE:
        before -= 1
    if before < 0 or before > _MAX_PREFIX:
        return None
    mark = data[before]
    if mark == 0x2C:  # ",": a later member; the comma before it goes with it
        if _depth(data[:before]) != 1:
            return None
        return data[:before] + data[end:], data[start:end]
    if mark == 0x7B:  # "{": the first member; the comma after it goes with it
        if data[:before].strip(_WHITESPACE):
            return None  # not the top-level object's brace
        after = _skip(data, end)
        resume = _skip(data, after + 1) if data[after : after + 1] == b"," else end
        return data[:key] + data[resume:], data[start:end]
    return None


def _skip(data: bytes, at: int) -> int:
    while data[at : at + 1] in (b" ", b"\t", b"\r", b"\n"):
        at += 1
    return at


def _holds_values(data: bytes, start: int, end: int) -> bool:
    """Whether the array's text holds a string, array or object (then its first ``]``
    need not be its end)."""
    return (data.find(b"[", start, end) >= 0 or data.find(b'"', start, end) >= 0
            or data.find(b"{", start, end) >= 0)


def _depth(prefix: bytes) -> int:
    """How many objects and arrays are open at the end of ``prefix`` (strings skipped)."""
    bare = _STRING.sub(b"", prefix)
    return bare.count(b"{") + bare.count(b"[") - bare.count(b"}") - bare.count(b"]")
