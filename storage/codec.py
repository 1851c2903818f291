"""Compact token arrays: ids as little-endian int32, logprobs as float64 bytes.

float64 keeps the upstream's JSON numbers exact; exporters narrow to float32.
"""

from __future__ import annotations

import struct
import sys
from array import array

_SWAP = sys.byteorder != "little"


def _pack(code: str, values: list) -> bytes:
    # struct packs a list about 3x faster than array(code, values).tobytes().
    return struct.pack(f"<{len(values)}{code}", *values)


def _unpack(code: str, data: bytes) -> list:
    arr = array(code)
    arr.frombytes(data)
    if _SWAP:
        arr.byteswap()
    return arr.tolist()


def pack_ids(ids: list[int] | None) -> bytes | None:
    return None if ids is None else _pack("i", ids)


def unpack_ids(data: bytes | None) -> list[int] | None:
    return None if data is None else _unpack("i", bytes(data))


def pack_logprobs(values: list[float] | None) -> bytes | None:
    return None if values is None else _pack("d", values)


def unpack_logprobs(data: bytes | None) -> list[float] | None:
    return None if data is None else _unpack("d", bytes(data))


def _view(code: str, data: bytes) -> memoryview | array:
    if _SWAP:
        arr = array(code)
        arr.frombytes(data)
        arr.byteswap()
        return arr
    return memoryview(data).cast(code)


def ids_view(data: bytes | None) -> memoryview | array | None:
    """Like unpack_ids, without a Python int per token: a typed view over the stored
    bytes (an ``array`` copy on big-endian hosts). For bulk readers (export)."""
    return None if data is None else _view("i", data)


def logprobs_view(data: bytes | None) -> memoryview | array | None:
    """Like unpack_logprobs, as a typed view (see ids_view)."""
    return None if data is None else _view("d", data)
