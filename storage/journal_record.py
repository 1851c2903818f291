"""A CallRecord as the journal holds it (msgpack), and back.

A record whose prompt ids came packed (``CallRecord.prompt_ids_packed``) is journaled
with the packed bytes only: one copy of ~4 bytes a token, where msgpack would encode
tens of thousands of ints one by one at every call of a long conversation, and reads
back the same way. Journals written before packed ids existed hold the list and read
as they are: both shapes decode with the same CallRecord, and storage takes either
(``records.prompt_ids_of``).

``pieces`` gives the same bytes as ``encode`` in pieces: a long conversation's request
(~535 KB at 72k tokens) and its packed ids (~290 KB) go to the journal's one write as
they are, after the rest of the record encoded small, instead of being copied into a
fresh ~0.9 MB buffer that the encoder grows by doubling (~150 µs a turn).
"""

from __future__ import annotations

import os

import msgspec

from tracetap.storage.records import CallRecord

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(CallRecord).decode
# Written apart from the rest from this size on: from 2**16 bytes msgpack heads a str with
# 0xdb and a bin with 0xc6, then the length as 4 big-endian bytes.
_APART = 1 << 16
_STR32, _BIN32 = b"\xdb", b"\xc6"
# Stand-ins the record is encoded with, found again in its bytes and replaced by the real
# values' headers and bytes: random per process, so a record's own text never holds them
# (and a head that holds one twice is encoded whole).
_TOKEN = os.urandom(12).hex()
_REQUEST = "\x00journal request " + _TOKEN
_IDS = b"\x00journal ids " + _TOKEN.encode()
_REQUEST_MARK, _IDS_MARK = _encode(_REQUEST), _encode(_IDS)


def encode(record: CallRecord) -> bytes:
    """The journal's bytes for ``record`` (raises what msgpack raises on a value it
    cannot hold, as before: storage.storable fixes the record)."""
    if record.prompt_ids_packed is not None and record.prompt_ids is not None:
        record = msgspec.structs.replace(record, prompt_ids=None)  # one copy is enough
    return _encode(record)


def pieces(record: CallRecord, request_utf8: bytes | None = None) -> list[bytes]:
    """``encode(record)`` in pieces whose join is the very same bytes (raises what
    ``encode`` raises). ``request_utf8``: ``record.request`` encoded in UTF-8, when the
    caller holds it (the client's body the request was decoded from, no byte replaced):
    written as it is, no copy made."""
    if record.prompt_ids_packed is not None and record.prompt_ids is not None:
        record = msgspec.structs.replace(record, prompt_ids=None)
    request, packed = record.request, record.prompt_ids_packed
    text = None
    if request is not None and len(request) >= _APART:
        try:
            text = request.encode("utf-8") if request_utf8 is None else request_utf8
        except UnicodeEncodeError:  # a lone surrogate: the encoder says so, as before
            return [_encode(record)]
    ids = packed if packed is not None and len(packed) >= _APART else None
    if text is None and ids is None:
        return [_encode(record)]
    head = _encode(msgspec.structs.replace(
        record, request=request if text is None else _REQUEST,
        prompt_ids_packed=packed if ids is None else _IDS))
    apart = sorted((head.find(mark), mark, tag, value) for mark, tag, value in (
        (_REQUEST_MARK, _STR32, text), (_IDS_MARK, _BIN32, ids)) if value is not None)
    out, at = [], 0
    for start, mark, tag, value in apart:
        if start < 0 or head.count(mark) != 1:
            return [_encode(record)]
        out += (head[at:start], tag + len(value).to_bytes(4, "big"), value)
        at = start + len(mark)
    out.append(head[at:])
    return out


def decode(payload: bytes) -> CallRecord:
    """A journaled record, in either shape."""
    return _decode(payload)
