"""Stored JSON bodies as a collapsible tree for the call page, bounded and with secrets hidden.

Bodies are the agent's (untrusted, possibly megabytes): strings are cut at STRING_LIMIT
characters and the tree at NODE_LIMIT nodes (the raw body is a download away). Values
under key names that carry credentials are never shown, wherever they appear.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tracetap.storage.credentials import HIDDEN, KEY

STRING_LIMIT = 10_000
NODE_LIMIT = 5_000
OPEN_DEPTH = 2  # levels open when the page loads
# Levels drawn at most: an agent may store JSON nested as deep as the decoder takes, and
# the page (and the recursion that builds it) must stay small.
MAX_DEPTH = 64
SECRET_KEY = KEY  # storage.credentials: the bodies come masked; the tree checks again


class Node(msgspec.Struct, kw_only=True):
    key: str | None
    kind: str  # object, array, string, number, bool, null, secret, more
    value: str = ""  # scalars: the text shown
    children: list[Node] = []
    size: int = 0  # object/array: members; string: characters cut
    open: bool = False


def parse(text: str | None) -> Any:
    """The body as JSON, or None when it is empty or not JSON (shown as text then)."""
    if not text:
        return None
    try:
        return msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError):  # too deep for the decoder: shown as text
        return None


def tree(value: Any) -> Node:
    budget = [NODE_LIMIT]
    return _node(None, value, 0, budget)


def _node(key: str | None, value: Any, depth: int, budget: list[int]) -> Node:
    budget[0] -= 1
    if key is not None and SECRET_KEY.match(key):
        return Node(key=key, kind="secret", value=HIDDEN)
    if isinstance(value, dict):
        return _container(key, "object", list(value.items()), len(value), depth, budget)
    if isinstance(value, list):
        return _container(key, "array", [(None, v) for v in value], len(value), depth, budget)
    if isinstance(value, str):
        cut = max(0, len(value) - STRING_LIMIT)
        return Node(key=key, kind="string", value=value[:STRING_LIMIT], size=cut)
    if isinstance(value, bool):
        return Node(key=key, kind="bool", value="true" if value else "false")
    if value is None:
        return Node(key=key, kind="null", value="null")
    return Node(key=key, kind="number", value=repr(value))


def _container(key, kind, items, size, depth, budget) -> Node:
    children = []
    if depth >= MAX_DEPTH and items:
        children.append(Node(key=None, kind="more", value=f"nested deeper than {MAX_DEPTH} "
                             "levels: see the raw JSON"))
        items = []
    for i, (k, v) in enumerate(items):
        if budget[0] <= 0:
            children.append(Node(key=None, kind="more", value=f"{len(items) - i} more not shown"))
            break
        children.append(_node(str(k) if k is not None else None, v, depth + 1, budget))
    return Node(key=key, kind=kind, children=children, size=size, open=depth < OPEN_DEPTH)
