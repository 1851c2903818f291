"""Append-only on-disk journal: every record lands here before it counts as captured.

Records are framed (length, crc32, payload) into segment files. The writer seals the
active segment, writes it to the database, and deletes it only after the commit; a
segment left over from a crash or an outage is replayed. A torn last frame (SIGKILL
mid-write) fails its checksum and is ignored: that record never reached the client.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("tracetap.journal")

_HEADER = struct.Struct("<II")  # payload length, crc32
_SUFFIX = ".seg"


class Journal:
    def __init__(self, directory: Path, max_bytes: int, segment_bytes: int = 16 << 20):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        self._sealed: list[Path] = sorted(self.directory.glob("*" + _SUFFIX))
        self._sealed_bytes = sum(p.stat().st_size for p in self._sealed)
        self.recovered_bytes = self._sealed_bytes  # left by a previous process
        self._next = 1 + max((int(p.stem) for p in self._sealed), default=0)
        self._fd: int | None = None
        self._active: Path | None = None
        self._active_bytes = 0
        self._active_records = 0

    @property
    def bytes(self) -> int:
        return self._sealed_bytes + self._active_bytes

    @property
    def active_records(self) -> int:
        return self._active_records

    def recovered(self) -> list[Path]:
        """Segments that were on disk when the journal opened (to replay)."""
        return list(self._sealed)

    def append(self, payload: bytes, slack: int = 0) -> bool:
        """Append one record; False when the journal is full (the caller counts a drop).
        ``slack``: bytes it may go past its bound (tombstones, storage.tombstones)."""
        frame = _HEADER.pack(len(payload), zlib.crc32(payload)) + payload
        if self.bytes + len(frame) > self.max_bytes + slack:
            return False
        if self._fd is None:
            self._open_active()
        # One write(2) per record: the page cache keeps it across a SIGKILL.
        os.write(self._fd, frame)
        self._active_bytes += len(frame)
        self._active_records += 1
        return True

    @property
    def active_full(self) -> bool:
        return self._active_bytes >= self.segment_bytes

    def seal(self) -> Path | None:
        """Close the active segment and queue it for writing; None if it was empty."""
        if self._fd is None:
            return None
        os.close(self._fd)
        sealed = self._active
        self._sealed.append(sealed)
        self._sealed_bytes += self._active_bytes
        self._fd, self._active, self._active_bytes, self._active_records = None, None, 0, 0
        return sealed

    def pending(self) -> list[Path]:
        """Sealed segments, oldest first."""
        return list(self._sealed)

    def remove(self, segment: Path) -> None:
        size = segment.stat().st_size
        segment.unlink()
        self._sealed.remove(segment)
        self._sealed_bytes -= size

    def close(self) -> None:
        self.seal()

    def _open_active(self) -> None:
        self._active = self.directory / f"{self._next:012d}{_SUFFIX}"
        self._next += 1
        self._fd = os.open(self._active, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


def read_segment(segment: Path) -> Iterator[bytes]:
    """Yield each intact payload in a segment; stop at the first torn or corrupt frame."""
    data = segment.read_bytes()
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, crc = _HEADER.unpack_from(data, offset)
        start = offset + _HEADER.size
        payload = data[start : start + length]
        if len(payload) < length or zlib.crc32(payload) != crc:
            log.warning("journal %s: torn record at byte %d ignored", segment.name, offset)
            return
        yield payload
        offset = start + length


def adopt(orphan: Path, into: Path) -> int:
    """Move the segments of a journal no process will open again (``serve --workers`` run
    with fewer workers than before) into ``into``, to be replayed there; returns how many.
    Only while no process has either journal open."""
    segments = sorted(orphan.glob("*" + _SUFFIX))
    into.mkdir(parents=True, exist_ok=True)
    after = max((int(p.stem) for p in into.glob("*" + _SUFFIX)), default=0)
    for number, segment in enumerate(segments, start=after + 1):
        os.replace(segment, into / f"{number:012d}{_SUFFIX}")
    return len(segments)
