"""An export on a store without atomic rename (S3, GCS, ...): the manifest is the commit.

Each run writes its files straight under their final names, unique to the run
(``part-<run id>-NNNNN.parquet``), and only then replaces ``_manifest.json`` (one PUT,
which readers see whole or not at all). Readers use the files the manifest lists: a run
cut before its manifest leaves orphans that nothing lists, so its episodes are neither
visible nor counted as exported, and the next run writes them again under new names.

The next run deletes orphans older than ``ORPHAN_GRACE_SECONDS`` (younger ones may belong
to an export still running; they are left for a later run). There is no lock: a run
refuses to commit when the manifest changed since it started, so two concurrent runs
never list the same episode twice; the refused run's files become orphans.
"""

from __future__ import annotations

import contextlib
import time

import msgspec
import pyarrow.fs as pafs

from tracetap.exporters.location import Location
from tracetap.exporters.parquet import (
    DATASETS,
    IMAGES,
    LEDGER,
    MANIFEST,
    ExportError,
    Manifest,
    decode_manifest,
)

ORPHAN_GRACE_SECONDS = 6 * 3600.0


class StoreDir:
    """The ExportDir contract (open, sink, discard, commit, close) on a pyarrow FileSystem."""

    def __init__(self, location: Location):
        self.location = location
        self.fs = location.filesystem
        self.manifest: Manifest | None = None
        self.committed = False
        self.orphans_deleted = 0
        self._seen: bytes | None = None  # the manifest as read: a change means a rival run

    def open(self) -> StoreDir:
        try:
            self._seen = self._read()
            if self._seen is not None:
                self.manifest = decode_manifest(self._seen, self.location.display + "/" + MANIFEST)
            self._clean()
        except OSError as exc:
            raise ExportError(f"cannot read {self.location.display}: {exc}") from exc
        return self

    def sink(self, name: str) -> tuple[str, pafs.FileSystem]:
        return self.location.path(name), self.fs

    def discard(self, name: str) -> None:
        with contextlib.suppress(OSError):
            self.fs.delete_file(self.location.path(name))

    def commit(self, manifest: Manifest) -> None:
        if self._read() != self._seen:
            raise ExportError(f"another export committed to {self.location.display} while this "
                              "one ran; this run's files are not listed (orphans a later run "
                              "deletes): run it again")
        run = manifest.runs[-1]  # this run's files must be there, whole
        names = [*run.files, *run.ledger]
        infos = self.fs.get_file_info([self.location.path(name) for name in names])
        for name, info in zip(names, infos):
            if info.type != pafs.FileType.File:
                raise ExportError(f"{self.location.display}/{name} vanished before the commit")
        with self.fs.open_output_stream(self.location.path(MANIFEST)) as out:
            out.write(msgspec.json.format(msgspec.json.encode(manifest)))
        self.manifest, self.committed = manifest, True
        with contextlib.suppress(OSError):  # the next run deletes what is left
            self._delete_obsolete()

    def close(self) -> None:
        """Nothing to release: there is no lock on an object store."""

    def _read(self) -> bytes | None:
        path = self.location.path(MANIFEST)
        if self.fs.get_file_info(path).type != pafs.FileType.File:
            return None
        with self.fs.open_input_stream(path) as f:
            return f.read()

    def _clean(self) -> None:
        self._delete_obsolete()
        listed = set(self.manifest.written) if self.manifest else set()
        old = time.time() - ORPHAN_GRACE_SECONDS
        for directory in (*DATASETS, IMAGES, LEDGER):
            selector = pafs.FileSelector(self.location.path(directory), allow_not_found=True,
                                         recursive=True)
            for info in self.fs.get_file_info(selector):
                name = info.path[info.path.rfind(directory + "/"):]
                if (info.type == pafs.FileType.File and name not in listed
                        and (info.mtime is None or info.mtime.timestamp() < old)):
                    self.fs.delete_file(info.path)
                    self.orphans_deleted += 1

    def _delete_obsolete(self) -> None:
        listed = set(self.manifest.written) if self.manifest else set()
        for name in self.manifest.obsolete if self.manifest else ():
            if name not in listed:
                self.discard(name)
