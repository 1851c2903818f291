"""Compact token arrays: ids as little-endian int32, logprobs as float64 bytes.

float64 keeps the upstream's JSON numbers exact; exporters narrow to float32.
"""

from __future__ import annotations

import sys
from array import array

_SWAP = sys.byteorder != "little"


def _pack(code: str, values: list) -> bytes:
    arr = array(code, values)
    if _SWAP:
        arr.byteswap()
    return arr.tobytes()


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


def _native(code: str, data: bytes) -> array:
    arr = array(code)
    arr.frombytes(data)
    if _SWAP:
        arr.byteswap()
    return arr


def ids_array(data: bytes | None) -> array | None:
    """Like unpack_ids, as an ``array('i')``: bulk readers (export) skip per-token ints."""
    return None if data is None else _native("i", data)


def logprobs_array(data: bytes | None) -> array | None:
    """Like unpack_logprobs, as an ``array('d')``."""
    return None if data is None else _native("d", data)
