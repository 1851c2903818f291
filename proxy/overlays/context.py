"""What overlays added to one episode's model context, put back into every later request.

A harness resends its own history, which lacks what an overlay added (a reminder, a
recovery hint, a vetoed turn and its feedback). Each addition is kept with its anchor: the
position among the harness's messages where it went, and a digest of the messages before
it. A later request whose messages start with the same ones gets the addition back at the
same place, so the model's context only ever grows, the way a patched harness's would, and
the episode's prompts keep extending each other (one trajectory, the additions as
context). A request that rewrote that part of its history (a summary) does not match, and
gets none of it.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import msgspec

_encode = msgspec.json.encode


class Addition(NamedTuple):
    anchor: int  # the harness's messages before it
    digest: bytes  # of those messages
    messages: list[dict[str, Any]]


def leading_system(messages: list[dict[str, Any]]) -> int:
    """How many messages at the start are system (or developer) instructions."""
    n = 0
    while n < len(messages) and messages[n].get("role") in ("system", "developer"):
        n += 1
    return n


class Context:
    """One episode's additions, in the order they were made."""

    def __init__(self) -> None:
        self.additions: list[Addition] = []

    def add(
        self, harness: list[dict[str, Any]], anchor: int, messages: list[dict[str, Any]]
    ) -> None:
        self.additions.append(Addition(anchor, _digest(harness, anchor), messages))

    def apply(self, harness: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The model's messages: the harness's, with every addition that still fits."""
        if not self.additions:
            return harness
        digests: dict[int, bytes] = {}
        at: dict[int, list[dict[str, Any]]] = {}
        for added in self.additions:
            if added.anchor > len(harness):
                continue
            if added.anchor not in digests:
                digests[added.anchor] = _digest(harness, added.anchor)
            if digests[added.anchor] == added.digest:
                at.setdefault(added.anchor, []).extend(added.messages)
        out = list(harness)
        for anchor in sorted(at, reverse=True):  # from the end: earlier anchors stay valid
            out[anchor:anchor] = at[anchor]
        return out


def _digest(messages: list[dict[str, Any]], n: int) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for message in messages[:n]:
        h.update(_encode(message))
        h.update(b"\x00")
    return h.digest()
