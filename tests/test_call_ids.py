"""Call ids: RFC 9562 UUIDv7 strings, ordered by creation time."""

from __future__ import annotations

import time
import uuid

from tracetap.proxy.episodes.ids import uuid7


def test_call_ids_are_uuid7_strings_in_time_order():
    before = time.time_ns() // 1_000_000
    ids = [uuid7() for _ in range(500)]
    after = time.time_ns() // 1_000_000
    parsed = [uuid.UUID(i) for i in ids]
    assert all(str(u) == i for u, i in zip(parsed, ids))  # canonical lowercase form
    assert {u.version for u in parsed} == {7} and {u.variant for u in parsed} == {uuid.RFC_4122}
    stamps = [u.int >> 80 for u in parsed]  # the 48-bit unix milliseconds
    assert stamps == sorted(stamps) and before <= stamps[0] and stamps[-1] <= after
    assert len(set(ids)) == len(ids)
