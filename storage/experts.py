"""The MoE experts each completion token was routed to: packed once, stored as a block.

vLLM (``--enable-return-routed-experts``) answers a choice's routing as a
``[tokens][layers][top_k]`` array of expert ids; SGLang with ``return_routed_experts``
sends them flat, without the shape, and is stored as ``[tokens][1][layers * top_k]``
(proxy.call.routed_experts).
Storage keeps it as bytes: ``layers`` and ``top_k`` (uint16 each), then every id as int16
little-endian, token by token, one compressed block per choice
(``choices.routed_experts_refs``, revision 0009).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence

EXPERTS = b"moe"  # the block kind (storage.blocks): part of its hash
_HEAD = struct.Struct("<HH")


class BadRouting(ValueError):
    """An engine's routing array that is not [tokens][layers][top_k] ints."""


def pack(routing: Sequence[Sequence[Sequence[int]]]) -> bytes:
    """``[tokens][layers][top_k]`` → the stored bytes (raises BadRouting)."""
    layers = len(routing[0]) if routing else 0
    top_k = len(routing[0][0]) if layers else 0
    flat = array("h")
    try:
        for token in routing:
            if len(token) != layers or any(len(layer) != top_k for layer in token):
                raise BadRouting("routing rows differ in shape")
            for layer in token:
                flat.extend(layer)
    except (TypeError, OverflowError) as exc:
        raise BadRouting(str(exc)) from None
    if flat.itemsize != 2:  # pragma: no cover - array('h') is 16-bit on every platform
        raise BadRouting("int16 is not 2 bytes here")
    return _HEAD.pack(layers, top_k) + _little(flat)


def unpack(data: bytes) -> list[list[list[int]]]:
    """The stored bytes → ``[tokens][layers][top_k]``."""
    layers, top_k = _HEAD.unpack_from(data)
    flat = array("h")
    flat.frombytes(data[_HEAD.size:])
    if struct.pack("=h", 1) != struct.pack("<h", 1):
        flat.byteswap()
    width = layers * top_k
    if width == 0:
        return []
    return [[list(flat[t + i * top_k:t + (i + 1) * top_k]) for i in range(layers)]
            for t in range(0, len(flat), width)]


def tokens(data: bytes) -> int:
    layers, top_k = _HEAD.unpack_from(data)
    width = layers * top_k * 2
    return 0 if width == 0 else (len(data) - _HEAD.size) // width


def _little(values: array) -> bytes:
    if struct.pack("=h", 1) != struct.pack("<h", 1):
        values = array("h", values)
        values.byteswap()
    return values.tobytes()
