"""Parquet export of captured episodes: per-call rows and training-ready trajectories.

    from exporters import export
    summary = export("sqlite:///tracetap-data/tracetap.db", "data/", incremental=True)

Names resolve on first use, so that ``tracetap serve`` (whose CLI imports
``exporters.command`` to describe its flags) never loads pyarrow.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "ADAPTERS",
    "CALLS_SCHEMA",
    "SCHEMA_VERSION",
    "SPLIT_REASONS",
    "TRAJECTORIES_SCHEMA",
    "ExportError",
    "ExportSummary",
    "Progress",
    "Trajectory",
    "build_trajectories",
    "export",
    "export_async",
]

_HOMES = {
    "ADAPTERS": ("exporters.adapters", "ADAPTERS"),
    "CALLS_SCHEMA": ("exporters.schema", "CALLS"),
    "SCHEMA_VERSION": ("exporters.schema", "SCHEMA_VERSION"),
    "SPLIT_REASONS": ("exporters.trajectories", "SPLIT_REASONS"),
    "TRAJECTORIES_SCHEMA": ("exporters.schema", "TRAJECTORIES"),
    "ExportError": ("exporters.parquet", "ExportError"),
    "ExportSummary": ("exporters.pipeline", "ExportSummary"),
    "Progress": ("exporters.pipeline", "Progress"),
    "Trajectory": ("exporters.trajectories", "Trajectory"),
    "build_trajectories": ("exporters.trajectories", "build_trajectories"),
    "export": ("exporters.pipeline", "export"),
    "export_async": ("exporters.pipeline", "export_async"),
}


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _HOMES[name]
    except KeyError:
        raise AttributeError(f"module 'exporters' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:
    from exporters.adapters import ADAPTERS
    from exporters.parquet import ExportError
    from exporters.pipeline import ExportSummary, Progress, export, export_async
    from exporters.schema import CALLS as CALLS_SCHEMA
    from exporters.schema import SCHEMA_VERSION
    from exporters.schema import TRAJECTORIES as TRAJECTORIES_SCHEMA
    from exporters.trajectories import SPLIT_REASONS, Trajectory, build_trajectories
