"""What translation writes to the client: minted ids and Server-Sent Events."""

from __future__ import annotations

import os
from typing import Any

import msgspec

_encode = msgspec.json.encode


def new_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(12).hex()}"


def sse_event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _encode(payload) + b"\n\n"
