"""Identifiers the proxy mints: UUIDv7 call ids (time-ordered, unique across replicas)."""

from __future__ import annotations

import os
import time


def uuid7() -> str:
    """RFC 9562 UUIDv7: 48-bit unix ms timestamp, then 74 random bits."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76
    value |= (rand >> 68 & 0xFFF) << 64
    value |= 0b10 << 62
    value |= rand & ((1 << 62) - 1)
    h = f"{value:032x}"  # uuid.UUID(int=...) costs more than the rest of this together
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def instance_id() -> str:
    """This process's id, stored with each call so replicas' sequences stay apart."""
    return f"{os.uname().nodename[:40]}-{os.getpid()}-{os.urandom(3).hex()}"
