"""One export run (``ExportRun``): pages of episodes in, trajectories built, datasets out.

Incremental runs keep a watermark in the manifest (exporters/watermark.py): the
finished_at below which every episode has been exported. It trails the newest exported
episode by SETTLE_SECONDS, so an episode whose finish committed late (its finished_at is
stamped before its transaction commits) is still picked up; episodes exported inside that
window are remembered by (id, finished_at) so they are never written twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterable
from datetime import datetime

import msgspec
import pyarrow.compute as pc

from tracetap import __version__
from tracetap.exporters.annotate import PageNotes, adopt, page_notes, without_infra
from tracetap.exporters.annotations import export_annotations
from tracetap.exporters.compaction import bodies_of, segments
from tracetap.exporters.drift import explain
from tracetap.exporters.images import IMAGES, ImageSink, trajectory_images
from tracetap.exporters.ledger import LedgerWriter
from tracetap.exporters.location import Location, resolve
from tracetap.exporters.objectstore import StoreDir
from tracetap.exporters.parquet import (
    DATASETS,
    DatasetWriter,
    ExportDir,
    ExportError,
    Manifest,
    RunRecord,
    Selection,
    run_id,
)
from tracetap.exporters.prefetch import prefetched
from tracetap.exporters.report import missing_note
from tracetap.exporters.schema import (
    SCHEMA_VERSION,
    SCHEMAS,
    calls_batches,
    ledger_batch,
    trajectories_batch,
    with_metadata,
)
from tracetap.exporters.settled import current_holds, without_held
from tracetap.exporters.trajectories import build_trajectories
from tracetap.exporters.watermark import Recent
from tracetap.storage.replicas import Holds
from tracetap.storage.scan import EpisodeFilter, Reader, ScanError, ScanPage


class Progress(msgspec.Struct, kw_only=True):
    episodes: int
    episodes_total: int
    calls: int
    trajectories: int
    tokens: int
    seconds: float


class ExportSummary(msgspec.Struct, kw_only=True):
    """What a run wrote: token ids per dataset, and of the trajectories' response ids
    those trained on (response_mask 1)."""

    out: str
    episodes: int = 0
    calls: int = 0
    call_rows: int = 0
    call_ids: int = 0  # calls/: prompt_ids + completion_ids
    trajectories: int = 0
    trajectory_ids: int = 0  # trajectories/: prompt_ids + response_ids
    trained_tokens: int = 0  # trajectories/: response_mask == 1
    files: list[str] = []
    seconds: float = 0.0
    watermark: float | None = None
    # (call, choice) pairs left out of trajectories/ for lack of token ids, by why.
    left_out: dict[str, int] = {}
    # Rows off an episode's main line, by cause: the drift cause of a "non_prefix" row,
    # else its split_reason (sample, retry, branch, compaction, no_token_ids).
    splits: dict[str, int] = {}
    # Of the --episode ids asked for, those not exported for these reasons.
    not_found: list[str] = []
    not_finished: list[str] = []
    # Episodes left out by --exclude-infra (their integrity verdict is infra).
    excluded_infra: int = 0
    # Episodes left for a later run: calls not all stored yet (exporters/settled.py).
    held: int = 0
    annotations: int = 0  # rows of the annotations/ snapshot written (exporters.annotations)

    @property
    def tokens(self) -> int:
        """Every token id written, in both datasets."""
        return self.call_ids + self.trajectory_ids
    # Files of earlier cut runs that no manifest listed, deleted now (local: stray
    # temporaries; object storage: orphans past their grace period).
    orphans_deleted: int = 0


def export(db: str, out: str | os.PathLike, **options) -> ExportSummary:
    """Blocking export (runs its own event loop); see ``export_async`` for the options."""
    return asyncio.run(export_async(db, out, **options))


async def export_async(
    db: str,
    out: str | os.PathLike,
    *,
    since: float | datetime | None = None,
    until: float | datetime | None = None,
    episodes: Iterable[str] = (),
    group: str | None = None,
    finished_only: bool = True,
    datasets: Iterable[str] = DATASETS,
    incremental: bool = False,
    overwrite: bool = False,
    keep_untokenized: bool = False,
    exclude_infra: bool = False,
    progress: Callable[[Progress], None] | None = None,
    page_size: int = 256,
    s3_endpoint: str | None = None,
) -> ExportSummary:
    """Export episodes from database ``db`` (a SQLAlchemy URL) into ``out``: a directory,
    or a URI pyarrow or fsspec opens (``s3://bucket/prefix``; ``s3_endpoint`` for an
    S3-compatible server, as ``AWS_ENDPOINT_URL`` does).

    ``incremental`` appends only episodes finished since the last run into ``out``;
    without it an existing export is an error unless ``overwrite`` replaces it.
    Calls without token ids are left out of trajectories/ (``summary.left_out`` says how
    many and why) unless ``keep_untokenized`` keeps them as marked rows.
    """
    selection = Selection(since=_epoch(since), until=_epoch(until),
                          episode_ids=tuple(sorted(set(episodes))), group_id=group,
                          finished_only=finished_only, datasets=_datasets(datasets),
                          keep_untokenized=keep_untokenized, exclude_infra=exclude_infra)
    if incremental and not finished_only:
        raise ExportError("--incremental needs --finished-only: an unfinished episode can "
                          "still grow, so it cannot be exported once and for all")
    if incremental and overwrite:
        raise ExportError("--incremental and --overwrite contradict each other")
    started, clock = time.time(), time.perf_counter()
    location = resolve(out, s3_endpoint)
    try:
        # The database first: a bad URL or schema leaves no trace in the output directory.
        async with Reader(db, page_size=page_size,
                          with_bodies="calls" in selection.datasets,
                          with_calls="trajectories" in selection.datasets) as reader:
            missing = await _missing(reader, selection)
            summary = await ExportRun(reader, location, selection, incremental=incremental,
                                      overwrite=overwrite, progress=progress,
                                      started=started, clock=clock).run()
            summary.annotations = await export_annotations(reader, location, EpisodeFilter(
                since=selection.since, until=selection.until,
                episode_ids=selection.episode_ids, group_id=selection.group_id,
                finished_only=selection.finished_only))
    except ScanError as exc:
        raise ExportError(str(exc)) from exc
    summary.not_found, summary.not_finished = missing
    return summary


async def _missing(reader: Reader, selection: Selection) -> tuple[list[str], list[str]]:
    """The --episode ids that do not exist, and those unfinished when only finished ones
    are exported; an error when that leaves none, before anything is written."""
    if not selection.episode_ids:
        return [], []
    finished = await reader.finished_at(selection.episode_ids)
    not_found = [i for i in selection.episode_ids if i not in finished]
    not_finished = [i for i in selection.episode_ids
                    if selection.finished_only and i in finished and finished[i] is None]
    if len(not_found) + len(not_finished) == len(selection.episode_ids):
        raise ExportError(f"nothing exported: {missing_note(not_found, not_finished)}")
    return not_found, not_finished


class ExportRun:
    """One run from the open output to the committed manifest: the output and its
    writers, the manifest it extends, the summary it counts into and the watermark's
    overlap are its own state; ``run`` is the whole of it."""

    def __init__(self, reader: Reader, location: Location, selection: Selection, *,
                 incremental: bool, overwrite: bool,
                 progress: Callable[[Progress], None] | None, started: float, clock: float):
        self.reader = reader
        self.location = location
        self.selection = selection
        self.incremental = incremental
        self.overwrite = overwrite
        self.progress = progress
        self.started = started
        self.clock = clock
        self.out = location.display
        self.writers: dict[str, DatasetWriter] = {}
        self.ledger: LedgerWriter | None = None
        self.previous: Manifest | None = None
        self.summary = ExportSummary(out=self.out)
        self.recent = Recent(None, {})
        self.holds = Holds()  # episodes left for a later run (exporters/settled.py)
        self.rid = ""  # the run's id, from its start time
        self.total = 0  # episodes the filter selects, for progress
        self.images = ImageSink()  # the images the rows name, each written once

    async def run(self) -> ExportSummary:
        target = ExportDir(self.location.local) if self.location.local else StoreDir(
            self.location)
        target = target.open()
        try:
            await self._prepare(target)
            await self._stream()
            self._commit(target)
            self.summary.seconds = time.perf_counter() - self.clock
            return self.summary
        except BaseException as exc:
            if not target.committed:  # after the commit point the next run finishes the job
                for writer in (*self.writers.values(), *([self.ledger] if self.ledger else [])):
                    writer.abort()
            if isinstance(exc, OSError):
                raise ExportError(f"cannot write to {self.out}: {exc}") from exc
            raise
        finally:
            target.close()

    async def _prepare(self, target) -> None:
        """The manifest extended, the summary begun, the datasets' writers opened."""
        selection = self.selection
        previous = _previous(target.manifest, selection, self.incremental, self.overwrite)
        self.previous = previous
        # Images earlier runs of this export wrote are not written again.
        self.images = ImageSink(h for r in (previous.runs if previous else ()) for h in r.images)
        self.summary = ExportSummary(out=self.out, orphans_deleted=target.orphans_deleted)
        self.holds = await current_holds(self.reader)
        self.recent = Recent(previous.watermark if previous else None,
                              previous.recent if previous else {}, self.holds.floor)
        self.rid = run_id(self.started)
        self.writers = {name: DatasetWriter(target, name, self.rid,
                                            with_metadata(SCHEMAS[name], name, __version__))
                        for name in (*selection.datasets, IMAGES)}
        self.ledger = LedgerWriter(target, self.rid) if "calls" in self.writers else None

    def _commit(self, target) -> None:
        """The datasets' files closed, then the manifest: the run's commit point."""
        summary, previous = self.summary, self.previous
        kept = previous.files if previous else []
        for name, writer in self.writers.items():
            empty = name != IMAGES and not any(f.startswith(name + "/") for f in kept)
            summary.files += writer.finish(ensure_file=empty)
        watermark, overlap = (self.recent.result() if self.selection.finished_only
                              else (None, {}))
        summary.watermark = watermark
        run = RunRecord(run_id=self.rid, started_at=self.started,
                        seconds=time.perf_counter() - self.clock,
                        episodes=summary.episodes, calls=summary.calls,
                        trajectories=summary.trajectories, tokens=summary.tokens,
                        files=summary.files, ledger=self.ledger.finish() if self.ledger else [],
                        images=self.images.written)
        replaced = target.manifest if target.manifest is not previous else None
        target.commit(Manifest(
            schema_version=SCHEMA_VERSION, tracetap_version=__version__,
            selection=self.selection, watermark=watermark, recent=overlap,
            runs=[*(previous.runs if previous else ()), run],
            obsolete=[*replaced.written, *replaced.obsolete] if replaced else [],
        ))

    async def _stream(self) -> None:
        selection, previous, summary = self.selection, self.previous, self.summary
        filt = EpisodeFilter(
            since=selection.since, until=selection.until, episode_ids=selection.episode_ids,
            group_id=selection.group_id, finished_only=selection.finished_only,
            finished_from=previous.watermark if previous else None,
            skip=dict(previous.recent) if previous else {},
        )
        calls, trajectories = self.writers.get("calls"), self.writers.get("trajectories")
        self.total = await self.reader.count(filt)
        self._report()
        # Closed here, not left to the event loop's shutdown, when a write fails: the read
        # ahead must end while the database is still open (see prefetch.prefetched).
        async with contextlib.aclosing(prefetched(self.reader.episodes(filt))) as pages:
            async for whole in pages:
                whole, held = without_held(whole, self.holds)
                summary.held += len(held)
                notes = page_notes(whole.rows)  # integrity verdicts, lineages
                await adopt(self.reader.engine, whole, notes)
                page, excluded = (without_infra(whole, notes) if selection.exclude_infra
                                  else (whole, 0))
                summary.excluded_infra += excluded
                if trajectories is not None:  # first: linking compactions moves lineages
                    await self._add_trajectories(trajectories, page, notes)
                if calls is not None:
                    self._add_calls(calls, page, notes)
                    await asyncio.sleep(0)  # lets the prefetched page's queries move on
                self.images.write(self.writers[IMAGES])
                summary.episodes += len(page.episodes)
                for episode in whole.episodes:
                    if episode.finished_at is not None:
                        self.recent.add(episode.id, episode.finished_at)
                self._report()
        # Calls outside any episode never finish; they belong only to a whole-table export.
        if calls is not None and not (selection.finished_only or selection.episode_ids
                                      or selection.group_id):
            async for page in self.reader.untagged_calls(filt):
                self._add_calls(calls, page, page_notes(page.rows))
                self.images.write(self.writers[IMAGES])
            self._report()

    def _report(self) -> None:
        if self.progress is not None:
            s = self.summary
            self.progress(Progress(episodes=s.episodes, episodes_total=self.total,
                                   calls=s.calls, trajectories=s.trajectories,
                                   tokens=s.tokens, seconds=time.perf_counter() - self.clock))

    def _add_calls(self, writer: DatasetWriter, page: ScanPage, notes: PageNotes) -> None:
        summary = self.summary
        for batch in calls_batches(page.rows, page.episodes, writer.schema, notes, self.images):
            writer.add(batch)
            self.ledger.add(ledger_batch(batch, page.episodes))
            summary.calls += pc.count_distinct(batch.column("call_id")).as_py()
            summary.call_rows += batch.num_rows
            summary.call_ids += _tokens(batch, "prompt_ids", "completion_ids")

    async def _add_trajectories(self, writer: DatasetWriter, page: ScanPage,
                                notes: PageNotes) -> None:
        summary, keep = self.summary, self.selection.keep_untokenized
        rows = [(episode, notes.lineage_rows(t)) for episode in page.episodes
                for t in await segments(episode.calls, build_trajectories(
                    episode.calls, keep_untokenized=keep, left_out=summary.left_out,
                    lineages=notes.lineages), notes.lineages, functools.partial(
                        build_trajectories, episode.calls, keep_untokenized=keep),
                    bodies_of(self.reader, episode.calls))]
        drifted = [(e, t) for e, t in rows if t.drift_call_id is not None]
        if drifted:  # only split rows need bodies; read here when the page came without them
            calls = {c.call_id: c for e, _ in drifted for c in e.calls}
            if not self.reader.with_bodies:
                calls = await self.reader.bodies(sorted({
                    i for _, t in drifted
                    for i in (t.split_call_id or t.call_ids[0], t.drift_call_id)}))
            for _, t in drifted:
                explain(t, calls)
        for _, t in rows:
            if t.split_reason is not None:
                cause = t.drift_cause if t.split_reason == "non_prefix" else t.split_reason
                summary.splits[cause] = summary.splits.get(cause, 0) + 1
        images = await trajectory_images(rows, self.reader, self.images)
        batch = trajectories_batch(rows, writer.schema, notes, images)
        writer.add(batch)
        summary.trajectories += batch.num_rows
        summary.trajectory_ids += _tokens(batch, "prompt_ids", "response_ids")
        summary.trained_tokens += pc.sum(batch.column("response_mask").values).as_py() or 0


def _tokens(batch, *columns: str) -> int:
    """Token ids in ``columns`` (list columns of a freshly built batch)."""
    return sum(len(batch.column(name).values) for name in columns)


def _previous(manifest: Manifest | None, selection: Selection, incremental: bool,
              overwrite: bool) -> Manifest | None:
    """The manifest this run extends (incremental), or None for a fresh export."""
    if manifest is None or overwrite:
        return None
    if not incremental:
        raise ExportError("the output directory already holds an export; add --incremental "
                          "to append what is new, or --overwrite to replace it")
    if manifest.schema_version != SCHEMA_VERSION:
        raise ExportError(f"the export there has schema version {manifest.schema_version}, "
                          f"this tracetap writes {SCHEMA_VERSION}: the files would not mix; "
                          "export to a new directory or --overwrite")
    if manifest.selection != selection:
        ours, theirs = msgspec.structs.asdict(selection), msgspec.structs.asdict(manifest.selection)
        diff = ", ".join(f"{k}: {theirs[k]!r} then, {ours[k]!r} now"
                         for k in ours if ours[k] != theirs[k])
        raise ExportError(f"--incremental must select what the existing export did ({diff})")
    return manifest


def _epoch(value: float | datetime | None) -> float | None:
    if isinstance(value, datetime):
        return value.timestamp()
    return None if value is None else float(value)


def _datasets(names: Iterable[str]) -> tuple[str, ...]:
    names = [names] if isinstance(names, str) else list(names)
    chosen = tuple(n for n in DATASETS if n in set(names))
    unknown = set(names) - set(DATASETS)
    if unknown or not chosen:
        raise ExportError(f"datasets must be among {', '.join(DATASETS)}; got {sorted(names)}")
    return chosen
