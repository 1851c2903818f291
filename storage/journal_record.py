"""A CallRecord as the journal holds it (msgpack), and back.

A record whose prompt ids came packed (``CallRecord.prompt_ids_packed``) is journaled
with the packed bytes only: one copy of ~4 bytes a token, where msgpack would encode
tens of thousands of ints one by one at every call of a long conversation, and reads
back the same way. Journals written before packed ids existed hold the list and read
as they are: both shapes decode with the same CallRecord, and storage takes either
(``records.prompt_ids_of``).
"""

from __future__ import annotations

import msgspec

from tracetap.storage.records import CallRecord

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(CallRecord).decode


def encode(record: CallRecord) -> bytes:
    """The journal's bytes for ``record`` (raises what msgpack raises on a value it
    cannot hold, as before: storage.storable fixes the record)."""
    if record.prompt_ids_packed is not None and record.prompt_ids is not None:
        record = msgspec.structs.replace(record, prompt_ids=None)  # one copy is enough
    return _encode(record)


def decode(payload: bytes) -> CallRecord:
    """A journaled record, in either shape."""
    return _decode(payload)
