"""The key-value metadata at the head of a GGUF file, read without the tensors.

GGUF (llama.cpp's model format, version 2 and 3): ``GGUF``, a uint32 version, uint64
tensor and key counts, then each key (a uint64-length UTF-8 string), a uint32 value
type and the value; arrays are a uint32 item type, a uint64 count and the items. Only
this head is read (the ``gguf`` package's reader also maps every tensor, which takes
tens of seconds for a 262k-token vocabulary on a small CPU).
"""

from __future__ import annotations

import mmap
import struct
from array import array
from pathlib import Path
from typing import Any

# value type -> (struct format, array typecode) for the fixed-size ones
_SCALARS = {0: ("<B", "B"), 1: ("<b", "b"), 2: ("<H", "H"), 3: ("<h", "h"), 4: ("<I", "I"),
            5: ("<i", "i"), 6: ("<f", "f"), 7: ("<?", "B"), 10: ("<Q", "Q"), 11: ("<q", "q"),
            12: ("<d", "d")}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    pass


def read_metadata(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file")
        version, _tensors, count = struct.unpack_from("<IQQ", data, 4)
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        reader = _Reader(data, 24)
        out = {}
        for _ in range(count):
            key = reader.string()
            out[key] = reader.value(reader.u32())
        return out


class _Reader:
    def __init__(self, data: mmap.mmap, offset: int):
        self.data, self.at = data, offset

    def u32(self) -> int:
        (value,) = struct.unpack_from("<I", self.data, self.at)
        self.at += 4
        return value

    def string(self) -> str:
        (size,) = struct.unpack_from("<Q", self.data, self.at)
        start = self.at + 8
        self.at = start + size
        return self.data[start:self.at].decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item = self.u32()
            (count,) = struct.unpack_from("<Q", self.data, self.at)
            self.at += 8
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item in _SCALARS:
                fmt, code = _SCALARS[item]
                size = struct.calcsize(fmt)
                items = array(code, self.data[self.at:self.at + size * count])
                self.at += size * count
                return [bool(v) for v in items] if item == 7 else items.tolist()
            return [self.value(item) for _ in range(count)]  # arrays of arrays
        if kind in _SCALARS:
            fmt, _ = _SCALARS[kind]
            (value,) = struct.unpack_from(fmt, self.data, self.at)
            self.at += struct.calcsize(fmt)
            return value
        raise GGUFError(f"unknown GGUF value type {kind}")
