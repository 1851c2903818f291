"""Append-only on-disk journal: every record lands here before it counts as captured.

Records are framed (length, crc32, payload) into segment files. The writer seals the
active segment, writes it to the database, and deletes it only after the commit; a
segment left over from a crash or an outage is replayed. A torn last frame (SIGKILL
mid-write) fails its checksum and is ignored: that record never reached the client.
Reading stops at the first frame that is not whole; that is only worth a warning when
records of the segment follow it (damage in the middle). A segment its process never
sealed (SIGKILL, OOM) normally ends that way, and says so at info level.

A committed segment's file is kept (two at most) and written over by a later segment:
appending to a new file makes the kernel find a fresh page for every 4 KiB, which
costs more than the copy itself (~1 ms for the ~840 KB record of a 72k-token turn on
this project's VMs, against ~0.05 ms into pages it already has). So a segment starts
with a header naming the seed of its frames' checksums (its number when created): a
frame left over from the file's earlier life fails the checksum and is never read as
a record, and a sealed segment ends with a marker, so its leftover tail is not taken
for a torn write. Segments written before this (no header) read as before.
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
_FILE = struct.Struct("<4sI")  # magic, the seed of the segment's checksums
# Read as a frame's length the magic would be ~1.2 GiB, which no record is, so a segment
# without a header (written before there were headers) is never mistaken for one with.
_MAGIC = b"\xffTTJ"
_END = 0xFFFFFFFF  # the length of the marker a sealed segment ends with
_SUFFIX = ".seg"
_SPARE = ".spare"
_SPARES = 2  # committed segment files kept to be written over
REPLICA_FILE = "replica"  # the id of the replica that owns the journal (storage.intents)
ADOPTED_FILE = "adopted"  # ids of replicas whose segments this journal took over


class Journal:
    def __init__(self, directory: Path, max_bytes: int, segment_bytes: int = 16 << 20):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        self._sealed: list[Path] = sorted(self.directory.glob("*" + _SUFFIX))
        # The bytes of records in each sealed segment (what counts against max_bytes);
        # a segment left by a previous process counts its whole file.
        self._sizes = {p: p.stat().st_size for p in self._sealed}
        self._sealed_bytes = sum(self._sizes.values())
        self.recovered_bytes = self._sealed_bytes  # left by a previous process
        self._next = 1 + max((int(p.stem) for p in self._sealed), default=0)
        self._spares = sorted(self.directory.glob("*" + _SPARE))
        self._fd: int | None = None
        self._active: Path | None = None
        self._seed = 0
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

    def append(self, payload: bytes | list[bytes], slack: int = 0) -> bool:
        """Append one record (its bytes, or pieces of them: storage.journal_record.pieces);
        False when the journal is full (the caller counts a drop). ``slack``: bytes it
        may go past its bound (tombstones, storage.tombstones)."""
        parts = [payload] if isinstance(payload, bytes) else payload
        length = sum(map(len, parts))
        size = _HEADER.size + length
        if self.bytes + size > self.max_bytes + slack:
            return False
        if self._fd is None:
            self._open_active()
        crc = self._seed
        for part in parts:
            crc = zlib.crc32(part, crc)
        # One write(2) per record: the page cache keeps it across a SIGKILL.
        os.writev(self._fd, (_HEADER.pack(length, crc), *parts))
        self._active_bytes += size
        self._active_records += 1
        return True

    @property
    def active_full(self) -> bool:
        return self._active_bytes >= self.segment_bytes

    def seal(self) -> Path | None:
        """Close the active segment and queue it for writing; None if it was empty."""
        if self._fd is None:
            return None
        os.write(self._fd, _HEADER.pack(_END, self._seed))
        os.close(self._fd)
        sealed = self._active
        self._sealed.append(sealed)
        self._sizes[sealed] = self._active_bytes
        self._sealed_bytes += self._active_bytes
        self._fd, self._active, self._active_bytes, self._active_records = None, None, 0, 0
        return sealed

    def pending(self) -> list[Path]:
        """Sealed segments, oldest first."""
        return list(self._sealed)

    def remove(self, segment: Path) -> None:
        """Forget a committed segment; its file is kept to be written over, or deleted."""
        self._sealed.remove(segment)
        self._sealed_bytes -= self._sizes.pop(segment)
        if len(self._spares) < _SPARES and segment.stat().st_size <= 2 * self.segment_bytes:
            spare = segment.with_suffix(_SPARE)
            os.replace(segment, spare)
            self._spares.append(spare)
        else:
            segment.unlink()

    def close(self) -> None:
        self.seal()

    def _open_active(self) -> None:
        self._active = self.directory / f"{self._next:012d}{_SUFFIX}"
        self._seed = self._next & 0xFFFFFFFF
        self._next += 1
        if self._spares:  # written from its start, over the pages the file already has
            os.replace(self._spares.pop(), self._active)
        self._fd = os.open(self._active, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(self._fd, _FILE.pack(_MAGIC, self._seed))


def read_segment(segment: Path) -> Iterator[bytes]:
    """Yield each intact payload in a segment; stop at the first torn or corrupt frame."""
    data = segment.read_bytes()
    offset, seed = 0, 0
    if data[:4] == _MAGIC:
        offset, (_, seed) = _FILE.size, _FILE.unpack_from(data)
    while offset + _HEADER.size <= len(data):
        length, crc = _HEADER.unpack_from(data, offset)
        if length == _END and crc == seed:
            return
        start = offset + _HEADER.size
        payload = data[start : start + length]
        if len(payload) < length or zlib.crc32(payload, seed) != crc:
            _stopped(segment.name, data, offset, seed)
            return
        yield payload
        offset = start + length


def _stopped(name: str, data: bytes, offset: int, seed: int) -> None:
    """Say why reading stopped at ``offset``: damage in the middle (the segment's end
    marker, or an intact frame of this segment, comes later) is a warning; the tail of a
    segment whose process was killed before sealing it (a write cut short, or the leftover
    of the file's earlier use, whose frames fail this segment's seed) is expected."""
    sealed = data.find(_HEADER.pack(_END, seed), offset + _HEADER.size) != -1
    if sealed or _intact_after(data, offset, seed):
        log.warning("journal %s: damaged record at byte %d; the records after it are not "
                    "read", name, offset)
    else:
        log.info("journal %s: its process stopped before sealing it; the %d bytes after "
                 "its last whole record (byte %d) are no record of it and are ignored",
                 name, len(data) - offset, offset)


def _intact_after(data: bytes, offset: int, seed: int) -> bool:
    """Whether a frame of this segment starts where the damaged one says it ends."""
    length, _ = _HEADER.unpack_from(data, offset)
    after = offset + _HEADER.size + length
    if after + _HEADER.size > len(data):
        return False
    length, crc = _HEADER.unpack_from(data, after)
    payload = data[after + _HEADER.size : after + _HEADER.size + length]
    return len(payload) == length and zlib.crc32(payload, seed) == crc


def adopt(orphan: Path, into: Path) -> int:
    """Move the segments of a journal no process will open again (``serve --workers`` run
    with fewer workers than before) into ``into``, to be replayed there; returns how many.
    Only while no process has either journal open."""
    segments = sorted(orphan.glob("*" + _SUFFIX))
    for spare in orphan.glob("*" + _SPARE):
        spare.unlink()
    into.mkdir(parents=True, exist_ok=True)
    owner = orphan / REPLICA_FILE  # its lease is settled by the adopter (storage.intents)
    if owner.exists():
        with open(into / ADOPTED_FILE, "a") as adopted:
            adopted.write(owner.read_text().strip() + "\n")
        owner.unlink()
    after = max((int(p.stem) for p in into.glob("*" + _SUFFIX)), default=0)
    for number, segment in enumerate(segments, start=after + 1):
        os.replace(segment, into / f"{number:012d}{_SUFFIX}")
    return len(segments)
