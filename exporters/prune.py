"""``tracetap prune --exported OUT``: delete from the database what an export proves written.

The proof is the export's manifest and the ledgers it lists (exporters.ledger): each
committed run's calls, with the finished_at their episode had when written. Rows of
runs cut before their manifest are not listed, so they are never trusted.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import msgspec
import pyarrow as pa
import pyarrow.fs as pafs
from sqlalchemy.exc import SQLAlchemyError

from tracetap.exporters.ledger import read_ledger
from tracetap.exporters.location import Location, resolve
from tracetap.exporters.parquet import MANIFEST, ExportError, Manifest, decode_manifest
from tracetap.exporters.schema import CALL_LEDGER
from tracetap.storage.conversation import Readers
from tracetap.storage.engine import DatabaseURLError, create_engine, redact_url
from tracetap.storage.retention import Proven, PruneCounts, Unlinked, prune, sweep

EPISODES_PER_TRANSACTION = 500


class PruneSummary(msgspec.Struct, kw_only=True):
    exported: str  # the export location, credentials masked
    dry_run: bool
    counts: PruneCounts
    runs_without_ledger: int = 0  # written by a tracetap before ledgers: trusted for nothing
    seconds: float = 0.0


def prune_exported(db: str, exported: str | os.PathLike, *, dry_run: bool = False,
                   s3_endpoint: str | None = None,
                   readers: Readers | None = None) -> PruneSummary:
    """Delete the rows of database ``db`` that the export at ``exported`` holds.
    ``readers``: each API's request shape (``proxy.apis.registry.readers()``), by which
    the writer indexed the calls for search (SQLite's postings are removed by it)."""
    return asyncio.run(prune_exported_async(db, exported, dry_run=dry_run,
                                            s3_endpoint=s3_endpoint, readers=readers))


async def prune_exported_async(db: str, exported: str | os.PathLike, *, dry_run: bool = False,
                               s3_endpoint: str | None = None,
                               readers: Readers | None = None) -> PruneSummary:
    clock = time.perf_counter()
    location = resolve(exported, s3_endpoint)
    manifest = _manifest(location)
    ledger = _ledger(location, manifest)
    summary = PruneSummary(exported=location.display, dry_run=dry_run, counts=PruneCounts(),
                           runs_without_ledger=sum(1 for r in manifest.runs
                                                   if r.calls and not r.ledger))
    try:
        engine = create_engine(db)
    except DatabaseURLError as exc:
        raise ExportError(str(exc)) from exc
    try:
        unlinked = Unlinked()  # blocks the pruned calls referenced
        for proven, untagged in _chunks(ledger):
            await prune(engine, proven, untagged, summary.counts, dry_run=dry_run,
                        unlinked=unlinked, readers=readers)
        await sweep(engine, unlinked, summary.counts, dry_run=dry_run)
    except (SQLAlchemyError, OSError) as exc:
        detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        raise ExportError(f"cannot prune {redact_url(db)}: {detail}") from exc
    finally:
        await engine.dispose()
    summary.seconds = time.perf_counter() - clock
    return summary


def _manifest(location: Location) -> Manifest:
    where = f"{location.display.rstrip('/')}/{MANIFEST}"
    try:
        info = location.filesystem.get_file_info(location.path(MANIFEST))
        if info.type != pafs.FileType.File:
            raise ExportError(f"no export manifest at {where}: nothing is proven exported, "
                              "so nothing was pruned")
        with location.filesystem.open_input_stream(location.path(MANIFEST)) as f:
            data = f.read()
    except OSError as exc:
        raise ExportError(f"cannot read {where}: {exc}") from exc
    manifest = decode_manifest(data, where)
    if "calls" not in manifest.selection.datasets:
        raise ExportError(f"the export at {location.display} has no calls/ dataset: prune "
                          "trusts only exports of every call (--dataset all or calls)")
    return manifest


def _ledger(location: Location, manifest: Manifest) -> pa.Table:
    names = [name for run in manifest.runs for name in run.ledger]
    try:
        tables = [read_ledger(location, name) for name in names]
    except OSError as exc:
        raise ExportError(f"cannot read the ledger of {location.display}: {exc}") from exc
    table = pa.concat_tables(tables) if tables else CALL_LEDGER.empty_table()
    # Sorted by episode: a chunk then holds every version of each of its episodes.
    return table.sort_by([("episode_id", "ascending"), ("finished_at", "ascending")])


def _chunks(ledger: pa.Table) -> Iterator[tuple[Proven, list[str]]]:
    proven: Proven = {}
    untagged: list[str] = []
    for batch in ledger.to_batches(max_chunksize=65536):
        columns = (batch.column(n).to_pylist() for n in ("call_id", "episode_id", "finished_at"))
        for call_id, episode_id, finished_at in zip(*columns):
            if episode_id is None:
                untagged.append(call_id)
            else:
                if episode_id not in proven and len(proven) >= EPISODES_PER_TRANSACTION:
                    yield proven, []
                    proven = {}
                proven.setdefault(episode_id, {}).setdefault(finished_at, set()).add(call_id)
            if len(untagged) >= EPISODES_PER_TRANSACTION:
                yield {}, untagged
                untagged = []
    if proven or untagged:
        yield proven, untagged
