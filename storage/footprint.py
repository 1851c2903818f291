"""How many token ids the database holds, whatever the layout: for benchmarks and sizing.

Since revision 0007 prompt and completion ids live in blocks (storage.blocks) that calls
reference; a block shared by many calls holds its ids once. Rows written before keep them
inline (``length(prompt_ids) / 4``). ``stored_ids`` counts both, each block once (a
choice's completion resent in the next prompt is one block: storage.blocks.cut_ids).
"""

from __future__ import annotations

import msgspec
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.storage.blocks import unpack_refs
from tracetap.storage.tables import Call, Choice


class StoredIds(msgspec.Struct, kw_only=True):
    prompt: int = 0  # prompt ids held (each block once)
    completion: int = 0  # completion ids held
    prompt_tokens: int = 0  # the calls' prompt_tokens summed: what inline storage would hold
    shared: int = 0  # ids of blocks that are both (counted in each of the two above)

    @property
    def total(self) -> int:
        return self.prompt + self.completion - self.shared


async def stored_ids(engine: AsyncEngine) -> StoredIds:
    """Token ids held by the database at ``engine`` (reads every call's references)."""
    out = StoredIds()
    held_blocks: dict[str, dict[bytes, int]] = {}
    async with engine.connect() as conn:
        for field, refs, inline in (("prompt", Call.prompt_refs, Call.prompt_ids),
                                    ("completion", Choice.completion_ids_refs,
                                     Choice.completion_ids)):
            blocks: dict[bytes, int] = {}
            held = 0
            result = await conn.stream(select(refs, func.length(inline)))
            async for stored_refs, inline_bytes in result:
                held += (inline_bytes or 0) // 4
                if stored_refs is not None:
                    blocks.update(unpack_refs(stored_refs))
            setattr(out, field, held + sum(blocks.values()))
            held_blocks[field] = blocks
        out.shared = sum(n for h, n in held_blocks["prompt"].items()
                         if h in held_blocks["completion"])
        out.prompt_tokens = int((await conn.execute(
            select(func.coalesce(func.sum(Call.prompt_tokens), 0)))).scalar())
    return out
