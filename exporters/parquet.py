"""Streaming the datasets to Parquet, committed all at once through ``_manifest.json``.

This module writes into a local directory (``ExportDir``); ``exporters.objectstore`` is
the same contract on a store without rename. Here files are written under hidden
temporary names (``.part-….parquet.tmp``, which pyarrow, pandas and ``datasets`` skip).
The manifest is the commit point: it is replaced atomically, naming the run's files, and
only then are the files renamed into place. A run that fails or is killed before that
leaves nothing that looks complete; one killed after it is finished by the next run
(``reconcile``), which also deletes stray temps.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import msgspec
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

MANIFEST = "_manifest.json"
FORMAT = "tracetap-export"
DATASETS = ("calls", "trajectories")
# The images the rows of either name, once per run (exporters.images): written with them.
IMAGES = "images"
# Which calls each run wrote (exporters.ledger): what `tracetap prune` trusts.
LEDGER = "_ledger"
_LOCK = ".tracetap-export.lock"
_TEMP_SUFFIX = ".tmp"

# Row groups sized for trainers: whole groups are what readers fetch and decode at once.
ROW_GROUP_ROWS = {"calls": 4096, "trajectories": 1024, IMAGES: 64}
ROW_GROUP_BYTES = 16 << 20  # also cut a group when its rows hold this much data
FILE_ROWS = {"calls": 2_000_000, "trajectories": 250_000, IMAGES: 20_000}
# Low-cardinality strings; ids, JSON bodies and token lists are not worth a dictionary.
_DICTIONARY = ["episode_id", "group_id", "task_id", "endpoint", "model", "policy_version",
               "token_source", "finish_reason", "status", "split_reason", "outcome",
               "harness", "harness_config", "rewards"]
# No min/max statistics for these: lists, bodies, an image's bytes (its own statistic).
_LIST_COLUMNS = {"prompt_ids", "completion_ids", "completion_logprobs", "response_ids",
                 "response_mask", "response_logprobs", "call_ids", "choice_indices",
                 "policy_versions", "request", "response", "data", "images"}


class ExportError(Exception):
    """The export could not be written; the message says what and where, on one line
    (a storage error's own text, e.g. an S3 SDK's, may span several)."""

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))


class Selection(msgspec.Struct, kw_only=True, frozen=True):
    """What an export contains; an incremental run must ask for the same."""

    since: float | None = None
    until: float | None = None
    episode_ids: tuple[str, ...] = ()
    group_id: str | None = None
    finished_only: bool = True
    datasets: tuple[str, ...] = DATASETS
    keep_untokenized: bool = False
    exclude_infra: bool = False  # leave out episodes whose integrity is infra


class RunRecord(msgspec.Struct, kw_only=True):
    run_id: str
    started_at: float
    seconds: float
    episodes: int
    calls: int
    trajectories: int
    tokens: int
    files: list[str]
    # The run's ledger files: every call written to calls/, with its episode's finished_at.
    ledger: list[str] = []
    # The SHA-256 of each image the run wrote to images/: a later incremental run of the
    # same export writes only the others (exporters/images.py).
    images: list[str] = []


class Manifest(msgspec.Struct, kw_only=True):
    format: str = FORMAT
    schema_version: str
    tracetap_version: str
    selection: Selection
    # Incremental watermark: episodes finished at or after it may still be new...
    watermark: float | None = None
    # ...except these, already exported with exactly this finished_at.
    recent: dict[str, float] = {}
    runs: list[RunRecord] = []
    # Files of a replaced export, deleted after the commit (again on the next run if cut).
    obsolete: list[str] = []

    @property
    def files(self) -> list[str]:
        return [f for run in self.runs for f in run.files]

    @property
    def written(self) -> list[str]:
        """Every file the manifest holds: the datasets' and the ledgers'."""
        return [f for run in self.runs for f in (*run.files, *run.ledger)]


def decode_manifest(data: bytes, where: str) -> Manifest:
    try:
        return msgspec.json.decode(data, type=Manifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ExportError(f"{where} is not a tracetap export manifest: {exc}") from exc


class Target(Protocol):
    """Where a DatasetWriter's files go (ExportDir, objectstore.StoreDir)."""

    def sink(self, name: str) -> tuple[str, pafs.FileSystem | None]:
        """Where to write the file the manifest will call ``name``."""

    def discard(self, name: str) -> None:
        """Delete what ``sink(name)`` received (an aborted run)."""


class DatasetWriter:
    """Batches in, row groups out: packs batches into groups, rolls files, writes temps.

    Encoding and compressing a row group (pyarrow, without the GIL) runs on a thread of
    its own while the next page is read and built; at most one group is in flight, so
    memory stays at about two groups per dataset.
    """

    def __init__(self, target: Target, dataset: str, run_id: str, schema: pa.Schema):
        self.target = target
        self.dataset = dataset
        self.run_id = run_id
        self.schema = schema
        self.rows = 0
        self.files: list[str] = []  # relative final names, written as temps
        self._group: list[pa.RecordBatch] = []
        self._group_rows = 0
        self._group_bytes = 0
        self._writer: pq.ParquetWriter | None = None
        self._file_rows = 0
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"tracetap-{dataset}")
        self._in_flight: Future | None = None

    def add(self, batch: pa.RecordBatch) -> None:
        """Queue ``batch`` (of ``self.schema``); each full row group goes to disk."""
        rows, nbytes = batch.num_rows, batch.nbytes
        # A batch larger than a group is cut into group-sized slices (zero copy).
        step = min(ROW_GROUP_ROWS[self.dataset],
                   max(1, rows * ROW_GROUP_BYTES // nbytes) if nbytes else rows)
        for start in range(0, rows, max(step, 1)):
            part = batch.slice(start, step)
            self._group.append(part)
            self._group_rows += part.num_rows
            self._group_bytes += nbytes * part.num_rows // rows
            if (self._group_rows >= ROW_GROUP_ROWS[self.dataset]
                    or self._group_bytes >= ROW_GROUP_BYTES):
                self._flush()

    def finish(self, *, ensure_file: bool) -> list[str]:
        """Write what is queued and close; an empty dataset still gets a file if asked."""
        try:
            self._flush()
            if self._writer is None and ensure_file:
                self._open()
            self._close()
        finally:
            self._thread.shutdown()
        return self.files

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._close()
        self._thread.shutdown()
        for name in self.files:
            self.target.discard(name)

    def _flush(self) -> None:
        if not self._group:
            return
        group = pa.Table.from_batches(self._group, self.schema)
        self._group, self._group_rows, self._group_bytes = [], 0, 0
        self._wait()
        if self._writer is None or self._file_rows >= FILE_ROWS[self.dataset]:
            self._close()
            self._open()
        self._in_flight = self._thread.submit(self._writer.write_table, group,
                                              row_group_size=group.num_rows)
        self._file_rows += group.num_rows
        self.rows += group.num_rows

    def _wait(self) -> None:
        """Let the group in flight finish; its error, if any, is raised here."""
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            in_flight.result()

    def _open(self) -> None:
        name = f"{self.dataset}/part-{self.run_id}-{len(self.files):05d}.parquet"
        where, filesystem = self.target.sink(name)
        self.files.append(name)
        self._file_rows = 0
        self._writer = pq.ParquetWriter(where, self.schema, filesystem=filesystem,
                                        **writer_options(self.schema))

    def _close(self) -> None:
        try:
            self._wait()
        finally:
            if self._writer is not None:
                writer, self._writer = self._writer, None
                writer.close()


def writer_options(schema: pa.Schema) -> dict[str, Any]:
    """ParquetWriter settings for a dataset (the benchmark's baseline uses them too)."""
    return {
        "compression": "zstd",
        "use_dictionary": [c for c in _DICTIONARY if c in schema.names],
        "write_statistics": [c for c in schema.names if c not in _LIST_COLUMNS],
    }


def temp_path(final: Path) -> Path:
    return final.with_name("." + final.name + _TEMP_SUFFIX)


class ExportDir:
    """The output directory: its lock, its manifest, and the commit of a run."""

    def __init__(self, root: Path):
        self.root = root
        self.manifest: Manifest | None = None
        self.committed = False  # the run's manifest is written: its files must stay
        self.orphans_deleted = 0  # temps of cut runs, deleted on open
        self._lock_fd: int | None = None

    def open(self) -> ExportDir:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock()
            self.manifest = self._read_manifest()
            self._reconcile()
        except OSError as exc:
            self.close()
            raise ExportError(f"cannot write to {self.root}: {exc.strerror or exc}") from exc
        except ExportError:
            self.close()
            raise
        return self

    def sink(self, name: str) -> tuple[str, None]:
        path = temp_path(self.root / name)
        path.parent.mkdir(parents=True, exist_ok=True)
        return str(path), None

    def discard(self, name: str) -> None:
        with contextlib.suppress(OSError):
            temp_path(self.root / name).unlink()

    def commit(self, manifest: Manifest) -> None:
        """Make a run visible: the manifest first (atomic), then the files' final names."""
        for name in manifest.written:
            temp = temp_path(self.root / name)
            if temp.exists():
                _fsync(temp)
        _write_atomic(self.root / MANIFEST, msgspec.json.format(msgspec.json.encode(manifest)))
        self.manifest, self.committed = manifest, True
        self._reconcile()

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _lock(self) -> None:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - no advisory locks on Windows
            return
        fd = os.open(self.root / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise ExportError(f"another export is writing to {self.root}") from exc
        self._lock_fd = fd

    def _read_manifest(self) -> Manifest | None:
        path = self.root / MANIFEST
        if not path.exists():
            return None
        return decode_manifest(path.read_bytes(), str(path))

    def _reconcile(self) -> None:
        """Finish a cut commit (renames, deletions); drop temps no manifest names."""
        committed = set(self.manifest.written) if self.manifest else set()
        for name in committed:
            final, temp = self.root / name, temp_path(self.root / name)
            if not final.exists() and temp.exists():
                os.replace(temp, final)
        for name in self.manifest.obsolete if self.manifest else ():
            if name not in committed:
                with contextlib.suppress(FileNotFoundError):
                    (self.root / name).unlink()
        for dataset in (*DATASETS, IMAGES, LEDGER):
            directory = self.root / dataset
            if directory.is_dir():
                for temp in directory.glob(".part-*" + _TEMP_SUFFIX):
                    temp.unlink()
                    self.orphans_deleted += 1


def _write_atomic(path: Path, data: bytes) -> None:
    temp = path.with_name(path.name + _TEMP_SUFFIX)
    with open(temp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    # Durable before visible: a manifest must never name a file still in the page cache.
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if path.is_dir() else os.O_RDONLY
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_id(now: float | None = None) -> str:
    """Sortable and unique enough for a file name: UTC time plus random bits."""
    now = time.time() if now is None else now
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
    return f"{stamp}-{os.urandom(4).hex()}"
