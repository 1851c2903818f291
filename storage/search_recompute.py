"""A stored call's search text, recomputed from its rows (storage.search_text's choice).

The search index keeps a call's words, not its text (migration 0012), so whoever needs
the text again reads what the call stored: its request, choice texts and error, inline or
from its blocks (storage.blocks, since 0007), and gives them to ``search_text.text_of``,
as the writer did. Its users: the viewer's snippets (a page of calls), prune (SQLite's
contentless FTS5 deletes postings only given the text they were made from), migration
0011's backfill and 0012's downgrade (every call, a page at a time). Each is handed the
request shapes (``storage.conversation.Readers``) the writer was given.

Synchronous, on a SQLAlchemy ``Connection``: migrations run so, and an ``AsyncConnection``
hands one to ``run_sync``. The tables are named here by their columns (``sa.table``), not
through storage.tables, so a migration reads the columns as they were when it ran.
"""

from __future__ import annotations

from collections.abc import Iterator

import sqlalchemy as sa

from tracetap.storage.blocks import join_text, unpack_block, unpack_refs
from tracetap.storage.conversation import Readers
from tracetap.storage.search_text import failure, text_of

PAGE = 500  # calls per read, and ids per IN list (under every backend's limit)
_CALLS = sa.table("calls", *(sa.column(c) for c in (
    "call_id", "episode_id", "endpoint", "request", "request_refs", "error", "http_status",
    "response", "response_refs")))
_CHOICES = sa.table("choices", *(sa.column(c) for c in (
    "call_id", "choice_index", "text", "text_refs")))
_BLOCKS = sa.table("blocks", sa.column("hash"), sa.column("data"))

Text = tuple[str, str, str]  # (call_id, episode_id, text)


def every_call(conn: sa.Connection, readers: Readers | None = None) -> Iterator[list[Text]]:
    """The text of every call that has an episode and any text, a page of calls at a time
    (in call id order)."""
    after = ""
    while True:
        page = conn.execute(
            sa.select(_CALLS).where(_CALLS.c.call_id > after, _CALLS.c.episode_id.is_not(None))
            .order_by(_CALLS.c.call_id).limit(PAGE)).all()
        if not page:
            return
        after = page[-1].call_id
        yield texts(conn, page, readers)


def texts_of(conn: sa.Connection, call_ids: list[str],
             readers: Readers | None = None) -> dict[str, str]:
    """call id → its text, for those of ``call_ids`` stored with an episode and any text."""
    out = {}
    for start in range(0, len(call_ids), PAGE):
        page = conn.execute(sa.select(_CALLS).where(
            _CALLS.c.call_id.in_(call_ids[start:start + PAGE]),
            _CALLS.c.episode_id.is_not(None))).all()
        out.update((call_id, text) for call_id, _, text in texts(conn, page, readers))
    return out


def texts(conn: sa.Connection, page: list, readers: Readers | None = None) -> list[Text]:
    """The texts of a page of ``calls`` rows (those with any text)."""
    if not page:
        return []
    shapes = Readers() if readers is None else readers
    choices: dict[str, list] = {}
    for c in conn.execute(sa.select(_CHOICES).where(
            _CHOICES.c.call_id.in_([r.call_id for r in page]))
            .order_by(_CHOICES.c.call_id, _CHOICES.c.choice_index)):
        choices.setdefault(c.call_id, []).append((c.text, c.text_refs))
    blocks = _blocks(conn, [r.request_refs for r in page]
                     + [r.response_refs for r in page if r.http_status != 200]
                     + [refs for v in choices.values() for _, refs in v])
    out = []
    for r in page:
        response = None if r.http_status == 200 else _value(r.response, r.response_refs, blocks)
        body = text_of(_value(r.request, r.request_refs, blocks), shapes.shape(r.endpoint),
                       [_value(t, refs, blocks) for t, refs in choices.get(r.call_id, ())],
                       failure(r.error, r.http_status, response))
        if body:
            out.append((r.call_id, r.episode_id, body))
    return out


def _blocks(conn: sa.Connection, refs: list) -> dict[bytes, bytes]:
    wanted = sorted({h for r in refs if r is not None for h, _ in unpack_refs(bytes(r))})
    out = {}
    for start in range(0, len(wanted), PAGE):
        for h, data in conn.execute(sa.select(_BLOCKS.c.hash, _BLOCKS.c.data).where(
                _BLOCKS.c.hash.in_(wanted[start:start + PAGE]))):
            out[bytes(h)] = unpack_block(bytes(data))
    return out


def _value(inline, refs, blocks: dict[bytes, bytes]):
    if refs is None:
        return inline
    try:
        return join_text(blocks[h] for h, _ in unpack_refs(bytes(refs)))
    except KeyError:  # a block missing: the call cannot be read whole, nor indexed
        return inline
