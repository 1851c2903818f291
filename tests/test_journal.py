"""The on-disk journal on its own: framing, torn and corrupt records, segments, limits."""

from __future__ import annotations

import logging
import stat
import struct
import zlib

from tracetap.storage.journal import Journal, adopt, read_segment

PAYLOADS = [b"first", b"", b"x" * 1000, b"last one"]
FRAME = 8  # length + crc32
FILE_HEADER = 8  # magic + the seed of the segment's checksums


def _size(payloads: list[bytes]) -> int:
    return sum(FRAME + len(p) for p in payloads)


def _sealed(tmp_path, payloads=PAYLOADS):
    journal = Journal(tmp_path / "j", max_bytes=1 << 20)
    for payload in payloads:
        assert journal.append(payload)
    return journal, journal.seal()


def _crashed(tmp_path, payloads=PAYLOADS):
    """The active segment as a process that dies after these appends leaves it."""
    journal = Journal(tmp_path / "j", max_bytes=1 << 20)
    for payload in payloads:
        assert journal.append(payload)
    return tmp_path / "j" / "000000000001.seg"


def test_records_come_back_in_order_from_a_private_segment(tmp_path):
    journal = Journal(tmp_path / "new" / "nested" / "journal", max_bytes=1 << 20)
    assert journal.seal() is None  # nothing written yet: nothing to seal
    for payload in PAYLOADS:
        assert journal.append(payload)
    assert journal.active_records == len(PAYLOADS) and journal.bytes == _size(PAYLOADS)
    segment = journal.seal()
    assert journal.active_records == 0 and journal.bytes == _size(PAYLOADS)
    assert journal.pending() == [segment] and segment.name == "000000000001.seg"
    assert list(read_segment(segment)) == PAYLOADS
    # Prompts and completions are in there: only the proxy's user may read them.
    assert stat.S_IMODE(segment.stat().st_mode) == 0o600
    journal.remove(segment)
    assert journal.pending() == [] and journal.bytes == 0 and not segment.exists()


def test_a_torn_last_record_is_ignored_and_said_where_without_a_warning(tmp_path, caplog):
    segment = _crashed(tmp_path)
    segment.write_bytes(segment.read_bytes()[:-3])  # SIGKILL in the middle of the last write
    with caplog.at_level(logging.INFO, logger="tracetap.journal"):
        assert list(read_segment(segment)) == PAYLOADS[:-1]
    offset = FILE_HEADER + _size(PAYLOADS[:-1])
    # Expected after a kill: said at info level, where it stopped.
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(
        logging.INFO, f"journal {segment.name}: its process stopped before sealing it; "
        f"the {FRAME + len(PAYLOADS[-1]) - 3} bytes after its last whole record "
        f"(byte {offset}) are no record of it and are ignored")]


def test_a_killed_process_over_a_reused_file_leaves_no_warning(tmp_path, caplog):
    """The active segment written over a committed one's file: after a SIGKILL the old
    frames follow the new ones; they are no torn record."""
    journal = Journal(tmp_path / "j", max_bytes=1 << 20)
    for payload in PAYLOADS * 3:
        journal.append(payload)
    journal.remove(journal.seal())
    journal.append(b"new")  # killed here: never sealed
    with caplog.at_level(logging.INFO, logger="tracetap.journal"):
        (segment,) = Journal(tmp_path / "j", 1 << 20).recovered()
        assert list(read_segment(segment)) == [b"new"]
    assert [r.levelno for r in caplog.records] == [logging.INFO]


def test_a_corrupt_record_ends_the_segment_there_with_a_warning(tmp_path, caplog):
    _, segment = _sealed(tmp_path)
    data = bytearray(segment.read_bytes())
    offset = FILE_HEADER + _size(PAYLOADS[:2])
    data[offset + FRAME + 500] ^= 0xFF  # bit rot in the 3rd payload
    segment.write_bytes(bytes(data))
    with caplog.at_level(logging.INFO, logger="tracetap.journal"):
        assert list(read_segment(segment)) == PAYLOADS[:2]
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(
        logging.WARNING, f"journal {segment.name}: damaged record at byte {offset}; the "
        "records after it are not read")]


def test_damage_in_the_middle_of_a_killed_process_segment_is_a_warning(tmp_path, caplog):
    segment = _crashed(tmp_path)  # never sealed: no end marker to find
    data = bytearray(segment.read_bytes())
    data[FILE_HEADER + FRAME] ^= 0xFF  # the first payload; intact records follow
    segment.write_bytes(bytes(data))
    with caplog.at_level(logging.INFO, logger="tracetap.journal"):
        assert list(read_segment(segment)) == []
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_an_empty_last_record_is_read(tmp_path):
    _, segment = _sealed(tmp_path, [b"a", b""])  # the segment ends with a bare header
    assert list(read_segment(segment)) == [b"a", b""]


def test_a_cut_inside_a_header_is_ignored(tmp_path):
    segment = _crashed(tmp_path)
    segment.write_bytes(segment.read_bytes() + b"\x05\x00\x00")  # 3 of a header's 8 bytes
    assert list(read_segment(segment)) == PAYLOADS


def test_segments_left_on_disk_are_recovered_and_numbering_goes_on(tmp_path):
    journal = Journal(tmp_path / "j", max_bytes=1 << 20)
    journal.append(b"a")
    first = journal.seal()
    journal.append(b"bb")
    second = journal.seal()
    journal.append(b"ccc")  # the process dies with this segment still active
    active = tmp_path / "j" / "000000000003.seg"
    assert [first.name, second.name] == ["000000000001.seg", "000000000002.seg"]

    reopened = Journal(tmp_path / "j", max_bytes=1 << 20)
    assert reopened.recovered() == [first, second, active]
    assert reopened.pending() == [first, second, active]
    # Left by a previous process, a segment counts as its whole file: three file headers
    # and the two sealed ones' end markers besides the records.
    assert reopened.bytes == _size([b"a", b"bb", b"ccc"]) + 3 * FILE_HEADER + 2 * FRAME
    reopened.append(b"dddd")
    newest = reopened.seal()
    assert newest.name == "000000000004.seg"
    assert [list(read_segment(s)) for s in reopened.pending()] == [
        [b"a"], [b"bb"], [b"ccc"], [b"dddd"]]
    journal.close()


def test_a_full_journal_refuses_the_record_that_would_not_fit(tmp_path):
    journal = Journal(tmp_path / "j", max_bytes=2 * (FRAME + 10))
    assert journal.append(b"x" * 10) and journal.append(b"y" * 10)  # exactly full
    assert not journal.append(b"")  # even an empty record takes a header
    segment = journal.seal()
    assert not journal.append(b"z")  # sealed segments count until they are removed
    journal.remove(segment)
    assert journal.append(b"z" * 20) and journal.bytes == FRAME + 20
    journal.close()


def test_the_active_segment_is_full_at_segment_bytes(tmp_path):
    journal = Journal(tmp_path / "j", max_bytes=1 << 20, segment_bytes=2 * (FRAME + 10))
    journal.append(b"x" * 10)
    assert not journal.active_full
    journal.append(b"x" * 9)
    assert not journal.active_full  # one byte short
    journal.append(b"")
    assert journal.active_full
    journal.close()
    assert journal.pending() and journal.bytes == _size([b"x" * 10, b"x" * 9, b""])


def test_an_orphan_journal_is_adopted_after_the_segments_already_there(tmp_path):
    """serve --workers run with fewer workers than before: worker 0 replays the rest."""
    own, orphan = Journal(tmp_path / "journal", 1 << 20), Journal(tmp_path / "journal-2", 1 << 20)
    for journal, payloads in ((own, [b"own"]), (orphan, [b"o1"]), (orphan, [b"o2"])):
        for payload in payloads:
            journal.append(payload)
        journal.seal()
    assert adopt(tmp_path / "journal-2", tmp_path / "journal") == 2
    assert not list((tmp_path / "journal-2").iterdir())
    reopened = Journal(tmp_path / "journal", 1 << 20)
    assert [p for s in reopened.recovered() for p in read_segment(s)] == [b"own", b"o1", b"o2"]


def test_a_committed_segment_is_written_over_and_its_old_records_never_come_back(tmp_path):
    """A fresh file costs a new page per 4 KiB; the next segment reuses the committed
    one's file, and its leftover frames, although intact, fail the new seed."""
    journal = Journal(tmp_path / "j", max_bytes=1 << 20)
    same = [b"a" * 100, b"b" * 100, b"c" * 100]  # equal sizes: old frames start where
    for payload in same:                          # a new one would
        journal.append(payload)
    old = journal.seal()
    inode = old.stat().st_ino
    journal.remove(old)
    assert journal.bytes == 0 and journal.pending() == [] and not old.exists()
    journal.append(b"d" * 100)  # the process dies with this segment active
    new = tmp_path / "j" / "000000000002.seg"
    assert new.stat().st_ino == inode and new.stat().st_size > FILE_HEADER + FRAME + 100
    assert list(read_segment(new)) == [b"d" * 100]
    assert [list(read_segment(s)) for s in Journal(tmp_path / "j", 1 << 20).recovered()] == [
        [b"d" * 100]]


def test_a_sealed_segment_over_a_longer_file_reads_to_its_end_without_a_warning(tmp_path,
                                                                                caplog):
    journal = Journal(tmp_path / "j", max_bytes=1 << 20)
    journal.append(b"x" * 5000)
    journal.remove(journal.seal())
    journal.append(b"short")
    segment = journal.seal()
    with caplog.at_level(logging.WARNING, logger="tracetap.journal"):
        assert list(read_segment(segment)) == [b"short"]
    assert caplog.records == []
    assert journal.bytes == FRAME + 5


def test_a_segment_written_before_headers_reads_as_before(tmp_path):
    segment = tmp_path / "000000000001.seg"
    segment.write_bytes(b"".join(struct.pack("<II", len(p), zlib.crc32(p)) + p
                                 for p in PAYLOADS))
    assert list(read_segment(segment)) == PAYLOADS


def test_at_most_two_committed_files_are_kept(tmp_path):
    journal = Journal(tmp_path / "j", max_bytes=1 << 20)
    segments = []
    for i in range(4):
        journal.append(b"%d" % i)
        segments.append(journal.seal())
    for segment in segments:
        journal.remove(segment)
    assert sorted(p.suffix for p in (tmp_path / "j").iterdir()) == [".spare", ".spare"]
