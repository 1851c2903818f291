"""Reading what storage.dedup wrote: a call's prompt ids and bodies from its references.

The one reconstruction every reader of ``calls`` goes through (the export's scans, the
viewer's call pages, the admin API, analysis): ``resolve`` takes rows that carry both a
value column and its references column and gives back the value. Rows stored before
revision 0007 hold the value inline (their references are null) and come back as they
are. Each block a batch of rows names is read once, however many calls share it, so a
page of a conversation's calls reads its unique tokens, not every call's whole prompt.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from tracetap.storage.blocks import join_text, unpack_block, unpack_refs
from tracetap.storage.tables import Block

IDS, TEXT = "ids", "text"
_IN = 500  # hashes per IN list: under every backend's parameter limit


class MissingBlock(LookupError):
    """A call references a block the database does not hold (it was never stored or
    was deleted while referenced): the call cannot be read back whole."""


class Blocks:
    """Blocks read so far (unpacked), by hash."""

    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}

    async def load(self, conn: AsyncConnection, refs: Iterable[bytes | None]) -> None:
        wanted = {h for r in refs if r is not None for h, _ in unpack_refs(r)}
        wanted.difference_update(self._data)
        missing = sorted(wanted)
        for start in range(0, len(missing), _IN):
            chunk = missing[start:start + _IN]
            for h, data in await _fetch(conn, select(Block.hash, Block.data)
                                        .where(Block.hash.in_(chunk))):
                self._data[bytes(h)] = unpack_block(data)

    def join(self, refs: bytes) -> bytes:
        try:
            return b"".join([self._data[h] for h, _ in unpack_refs(refs)])
        except KeyError as exc:
            raise MissingBlock(f"block {exc.args[0].hex()} is not stored") from None

    def value(self, refs: bytes, kind: str) -> bytes | str:
        data = self.join(refs)
        return join_text([data]) if kind == TEXT else data


async def resolve(conn: AsyncConnection, rows: Sequence, pairs: Sequence[tuple[int, int, str]],
                  width: int, blocks: Blocks | None = None) -> list[tuple]:
    """``rows`` cut to their first ``width`` columns, each (value_at, refs_at, kind) of
    ``pairs`` filled from its references where the row has them: int32 little-endian
    bytes for IDS, text for TEXT."""
    blocks = blocks or Blocks()
    await blocks.load(conn, (row[r] for row in rows for _, r, _ in pairs))
    done: dict[tuple, bytes | str] = {}  # a call's rows (one per choice) share its refs
    out = []
    for row in rows:
        values = list(row[:width])
        for at, refs_at, kind in pairs:
            refs = row[refs_at]
            if refs is not None:
                key = (bytes(refs), kind)
                value = done.get(key)
                if value is None:
                    value = done[key] = blocks.value(key[0], kind)
                values[at] = value
        out.append(tuple(values))
    return out


async def _fetch(conn: AsyncConnection, query) -> list:
    return list((await conn.execute(query)).all())
