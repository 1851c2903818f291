"""Parquet export of captured episodes: per-call rows and training-ready trajectories.

    from tracetap.exporters import export
    summary = export("sqlite:///tracetap-data/tracetap.db", "data/", incremental=True)
    ray.data.read_parquet(files("data/", "trajectories"))  # only what the manifest lists

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
    "files",
]

_HOMES = {
    "ADAPTERS": ("tracetap.exporters.adapters", "ADAPTERS"),
    "CALLS_SCHEMA": ("tracetap.exporters.schema", "CALLS"),
    "SCHEMA_VERSION": ("tracetap.exporters.schema", "SCHEMA_VERSION"),
    "SPLIT_REASONS": ("tracetap.exporters.trajectories", "SPLIT_REASONS"),
    "TRAJECTORIES_SCHEMA": ("tracetap.exporters.schema", "TRAJECTORIES"),
    "ExportError": ("tracetap.exporters.parquet", "ExportError"),
    "ExportSummary": ("tracetap.exporters.pipeline", "ExportSummary"),
    "Progress": ("tracetap.exporters.pipeline", "Progress"),
    "Trajectory": ("tracetap.exporters.trajectories", "Trajectory"),
    "build_trajectories": ("tracetap.exporters.trajectories", "build_trajectories"),
    "export": ("tracetap.exporters.pipeline", "export"),
    "export_async": ("tracetap.exporters.pipeline", "export_async"),
    "files": ("tracetap.exporters.listing", "files"),
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
    from tracetap.exporters.adapters import ADAPTERS
    from tracetap.exporters.listing import files
    from tracetap.exporters.parquet import ExportError
    from tracetap.exporters.pipeline import ExportSummary, Progress, export, export_async
    from tracetap.exporters.schema import CALLS as CALLS_SCHEMA
    from tracetap.exporters.schema import SCHEMA_VERSION
    from tracetap.exporters.schema import TRAJECTORIES as TRAJECTORIES_SCHEMA
    from tracetap.exporters.trajectories import SPLIT_REASONS, Trajectory, build_trajectories
