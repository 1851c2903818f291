"""A run's ledger: every call it wrote to calls/, with its episode's finished_at.

``_ledger/part-<run id>-00000.arrow`` (Arrow IPC, zstd; not Parquet, so no reader of
``*.parquet`` ever mistakes it for data) is written beside the run's datasets and
committed with them by the manifest. ``tracetap prune`` deletes only what ledgers list.
"""

from __future__ import annotations

import contextlib

import pyarrow as pa

from tracetap.exporters.location import Location
from tracetap.exporters.parquet import LEDGER, Target, temp_path
from tracetap.exporters.schema import CALL_LEDGER


class LedgerWriter:
    def __init__(self, target: Target, run_id: str):
        self.target = target
        self.name = f"{LEDGER}/part-{run_id}-00000.arrow"
        self.opened = False
        self._sink: pa.NativeFile | None = None
        self._writer: pa.ipc.RecordBatchFileWriter | None = None

    def add(self, batch: pa.RecordBatch) -> None:
        if self._writer is None:
            where, filesystem = self.target.sink(self.name)
            self.opened = True
            self._sink = (filesystem.open_output_stream(where) if filesystem is not None
                          else pa.OSFile(where, "wb"))
            self._writer = pa.ipc.new_file(self._sink, CALL_LEDGER,
                                           options=pa.ipc.IpcWriteOptions(compression="zstd"))
        self._writer.write_batch(batch)

    def finish(self) -> list[str]:
        """The ledger's file (none when the run wrote no call)."""
        if self._writer is not None:
            self._close()
        return [self.name] if self.opened else []

    def abort(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._close()
        if self.opened:
            self.target.discard(self.name)

    def _close(self) -> None:
        writer, sink, self._writer, self._sink = self._writer, self._sink, None, None
        try:
            writer.close()
        finally:
            sink.close()


def read_ledger(location: Location, name: str) -> pa.Table:
    """A committed ledger; locally, one a cut commit has not renamed yet is read as its temp."""
    path = location.path(name)
    if location.local is not None:
        temp = temp_path(location.local / name)
        if not (location.local / name).exists() and temp.exists():
            path = str(temp)
    with location.filesystem.open_input_file(path) as f:
        return pa.ipc.open_file(f).read_all()

