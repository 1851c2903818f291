"""Policy-version spans of a completion's tokens: how they are stored and read back.

A choice stores ``[[start_token, version], ...]`` (JSON text, ``choices.policy_spans``)
only when its tokens are not all from the version its call was stamped with; a version of
``null`` marks tokens whose version is unknown (they arrived during a weight sync).
Without spans a choice is one span of ``calls.policy_version``: so rows written before
revision 0009 read as what they were.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

Span = tuple[int, str | None]  # (first token index, version or None: unknown)


def spans_of(stored: str | list | None, version: str | None, length: int) -> list[Span]:
    """A choice's spans as stored (JSON text, or a list) or, when none were stored, one
    span of the call's ``version`` (rows written before revision 0009 read this way)."""
    if stored is None:
        return [(0, version)] if length else []
    if isinstance(stored, str):
        stored = msgspec.json.decode(stored)
    return [(int(start), v) for start, v in stored]


def encode_spans(spans: list[Span] | None) -> str | None:
    return None if spans is None else msgspec.json.encode(spans).decode()


def mixed(spans: Iterable[Span]) -> bool:
    """Whether the tokens are not all from one known version."""
    versions = {v for _, v in spans}
    return len(versions) > 1 or None in versions
