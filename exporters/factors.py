"""Harness factors: an episode's harness config read as a flat ``{factor: level}`` object.

The convention (docs/harness-engineering.md): register an episode with
``{"harness": {"name": ..., "config": {factor: level, ...}}}``. Every scalar value is a
factor level, as text: strings as they are, numbers, booleans and null in their JSON
spelling (``3``, ``0.5``, ``true``, ``null``). Nested values (lists, objects) are not
factors. The trajectories export carries them as ``harness_factors`` so a trainer can
balance batches; ``tracetap harnesses`` reports their coverage.
"""

from __future__ import annotations

from typing import Any

import msgspec


def level(value: Any) -> str | None:
    """A config value as a factor level; None when it is not a scalar."""
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, (bool, int, float)):
        return msgspec.json.encode(value).decode()
    return None


def factors_of(config: Any) -> dict[str, str]:
    """The factors of a decoded harness config, in its key order."""
    if not isinstance(config, dict):
        return {}
    return {k: lv for k, v in config.items() if (lv := level(v)) is not None}


def factors_of_json(text: str | None) -> list[dict[str, str]]:
    """The ``harness_factors`` column's value: [{factor, level}] sorted by factor."""
    if not text:
        return []
    try:
        config = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return []
    return [{"factor": f, "level": v} for f, v in sorted(factors_of(config).items())]
