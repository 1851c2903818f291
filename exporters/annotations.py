"""The ``annotations/`` dataset: every label, comment and corrected reward people made
(storage.annotations), one row each, beside the episode's original reward.

A snapshot, not an append: annotations are made at any time, before or after their
episode is exported, so each ``tracetap export`` run rewrites the one file
``annotations/annotations.parquet`` whole (a temporary file renamed over it locally; one
object put on object storage); while there is none, there is no such file.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from sqlalchemy import select

from tracetap.exporters.location import Location
from tracetap.storage.annotations import Stored, every
from tracetap.storage.fetch import among
from tracetap.storage.scan import Reader
from tracetap.storage.tables import Episode

DATASET = "annotations"
FILE = f"{DATASET}/annotations.parquet"

SCHEMA = pa.schema([
    ("annotation_id", pa.int64()),
    ("episode_id", pa.string()),
    ("target", pa.string()),  # episode, call or span
    ("call_id", pa.string()),
    ("choice_index", pa.int32()),
    ("token_start", pa.int32()),  # of the choice's completion tokens
    ("token_end", pa.int32()),  # exclusive
    ("label", pa.string()),
    ("comment", pa.string()),
    ("corrected_reward", pa.float64()),
    ("original_reward", pa.float64()),  # episodes.reward as stored: never corrected
    ("author", pa.string()),
    ("source", pa.string()),  # viewer or api
    ("created_at", pa.float64()),  # epoch seconds
])


def table(found: list[Stored], rewards: dict[str, float | None]) -> pa.Table:
    return pa.Table.from_pylist([{
        "annotation_id": a.id, "episode_id": a.episode_id, "target": a.target,
        "call_id": a.call_id, "choice_index": a.choice_index, "token_start": a.token_start,
        "token_end": a.token_end, "label": a.label, "comment": a.comment,
        "corrected_reward": a.corrected_reward,
        "original_reward": rewards.get(a.episode_id), "author": a.author,
        "source": a.source, "created_at": a.created_at} for a in found], schema=SCHEMA)


async def snapshot(reader: Reader) -> pa.Table | None:
    """Every annotation with its episode's reward; None when there is none."""
    engine = reader.engine
    found = await every(engine)
    if not found:
        return None
    ids = sorted({a.episode_id for a in found})
    async with engine.connect() as conn:
        rows = (await conn.execute(select(Episode.id, Episode.reward).where(
            among(Episode.id, ids, engine)))).all()
    return table(found, {r[0]: r[1] for r in rows})


def write(location: Location, data: pa.Table) -> str:
    """``data`` as ``annotations/annotations.parquet`` under the export; its path."""
    if location.local is not None:
        final = Path(location.local) / FILE
        final.parent.mkdir(parents=True, exist_ok=True)
        temporary = final.with_name(final.name + ".tmp")
        pq.write_table(data, temporary)
        os.replace(temporary, final)  # readers see the old snapshot or the new, whole
        return str(final)
    path = location.path(FILE)
    location.filesystem.create_dir(location.path(DATASET), recursive=True)
    pq.write_table(data, path, filesystem=location.filesystem)
    return path


def remove(location: Location) -> None:
    """No annotations: an earlier snapshot in this export (another database's, before an
    --overwrite) must not be read as this one's."""
    path = str(Path(location.local) / FILE) if location.local is not None else location.path(
        FILE)
    filesystem = pafs.LocalFileSystem() if location.local is not None else location.filesystem
    if filesystem.get_file_info(path).type != pafs.FileType.NotFound:
        filesystem.delete_file(path)


async def export_annotations(reader: Reader, location: Location) -> int:
    """Write the snapshot; how many annotations it holds (0: none, and no file)."""
    data = await snapshot(reader)
    if data is None:
        remove(location)
        return 0
    write(location, data)
    return data.num_rows
