"""An image's bytes read back by its block hash, for the viewer's thumbnails.

An image block (storage.images) is named by ``digest(IMAGE, bytes)``: its hash is the key a
page links to. Only blocks stored as images are given out: a hash naming any other block
(a prompt's ids, a message's text) reads as absent, so the route cannot be used to read
other stored content byte by byte.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.storage.blocks import HASH_BYTES, digest
from tracetap.storage.images import FORM, IMAGE
from tracetap.storage.tables import Block


def key(data: bytes) -> str:
    """The hex block hash of an image's bytes: what a page links to."""
    return digest(IMAGE, data).hex()


async def image_bytes(engine: AsyncEngine, hex_hash: str) -> bytes | None:
    """The image stored under ``hex_hash``, or None (no such image block)."""
    try:
        wanted = bytes.fromhex(hex_hash)
    except ValueError:
        return None
    if len(wanted) != HASH_BYTES:
        return None
    async with engine.connect() as conn:
        stored = (await conn.execute(select(Block.data).where(Block.hash == wanted))).scalar()
    if stored is None or bytes(stored[:1]) != bytes((FORM,)):
        return None
    data = bytes(stored[1:])
    return data if key(data) == hex_hash else None
