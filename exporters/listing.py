"""The files an export's manifest lists: exactly what a reader (Ray Data, DuckDB,
``datasets``, pandas...) should read.

A directory read or a glob (``trajectories/*.parquet``) also picks up files the manifest
does not list: on an object store, those of a run cut before its commit, or refused
(exporters.objectstore), which stay until a later run deletes them. Their episodes are
written again by the next run, so reading them would duplicate rows. ``files`` reads the
manifest once and returns the listed files as URIs in the form ``uri`` was given, for
any reader that takes a list of paths; credentials come from the environment, as for
``export`` (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pyarrow.fs as pafs

from tracetap.exporters.location import is_remote, resolve
from tracetap.exporters.parquet import DATASETS, MANIFEST, ExportError, decode_manifest


def files(uri: str | os.PathLike, dataset: str, *, s3_endpoint: str | None = None) -> list[str]:
    """The files of ``dataset`` (``calls`` or ``trajectories``) that the export at ``uri``
    lists, oldest run first: ``s3://bucket/data/trajectories/part-….parquet`` for an
    ``s3://bucket/data`` export, local paths for a local one."""
    if dataset not in DATASETS:
        raise ExportError(f"no dataset {dataset!r}: an export holds {' and '.join(DATASETS)}")
    location = resolve(uri, s3_endpoint)
    manifest_path = location.path(MANIFEST)
    try:
        if location.filesystem.get_file_info(manifest_path).type != pafs.FileType.File:
            raise ExportError(f"{location.display} holds no export (no {MANIFEST})")
        with location.filesystem.open_input_stream(manifest_path) as f:
            data = f.read()
    except OSError as exc:
        raise ExportError(f"cannot read {location.display}/{MANIFEST}: {exc}") from exc
    manifest = decode_manifest(data, f"{location.display}/{MANIFEST}")
    return [_join(uri, name) for name in manifest.files if name.startswith(dataset + "/")]


def _join(uri: str | os.PathLike, name: str) -> str:
    text = os.fspath(uri)
    if not is_remote(text):
        local = text[len("file://"):] if text.startswith("file://") else text
        return str(Path(local) / name)
    parts = urlsplit(text)  # the name goes in the path; user part and query stay as given
    return urlunsplit(parts._replace(path=f"{parts.path.rstrip('/')}/{name}"))
