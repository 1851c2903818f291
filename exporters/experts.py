"""MoE routing in the export, aligned with the tokens (``--routed-experts``).

``calls.routed_experts`` holds a choice's routing token by token, aligned with its
``completion_ids``; ``trajectories.response_routed_experts`` is aligned with
``response_ids``: a completion token's ``[layers][top_k]`` expert ids, null for a token
the engine reported no routing for (observations, the prompt: prompt routing is not
stored). Both are null when no routing was captured.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tracetap.storage.experts import unpack

Routing = list[list[int]]  # one token: [layers][top_k]


def call_experts(columns: Mapping[str, Sequence]) -> list[list[Routing] | None]:
    return [None if data is None else unpack(data) for data in columns["routed_experts_refs"]]


def trajectory_experts(turns: Iterable[tuple[Any, int]],
                       length: int) -> list[Routing | None] | None:
    """``response_ids``-aligned routing from (choice, completion offset) turns."""
    out: list[Routing | None] | None = None
    for choice, offset in turns:
        data = getattr(choice, "routed_experts", None)
        if data is None:
            continue
        if out is None:
            out = [None] * length
        for i, token in enumerate(unpack(data)):
            if 0 <= offset + i < length:
                out[offset + i] = token
    return out
