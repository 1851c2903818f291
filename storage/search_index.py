"""The search index's rows: added by the writer with each batch, removed by prune.

The writer adds, in its batch's transaction, one ``call_text`` row per call that has an
episode and any text (storage.search_text): the call's id and episode, and its words,
not its text (migration 0012). Replaying a journal indexes once (the row is keyed by call
id; postings are added only for rows this batch added), and a refused batch indexes
nothing.

- Postgres: the row holds ``words``, the text's distinct words (``words()``) sorted and
  space-separated; a GIN index keys them by hash bucket (migration 0016, storage.search).
- SQLite: the row's ``id`` is the rowid of its postings in ``call_text_fts``, a
  contentless FTS5 table (``content=''``, ``detail=none``: which calls hold a word, not
  where). It keeps no text, so removing a call's postings takes the text they were made
  from: ``forget`` recomputes it from the stored call (storage.search_recompute) before
  the call goes. ``id`` is AUTOINCREMENT, never reused: a posting left behind (a text
  that could not be recomputed) names a row that no longer exists, and every search
  goes through ``call_text``, so it finds nothing. So is a posting left by a text that
  recomputes differently from what the writer indexed (an API's shape declared otherwise
  since, or its line gone from the registry): it names a deleted row, and a search never
  returns it.

What a call's text is depends on its API's request shape (``Readers.shape``), handed in
by whoever composes the writer (the proxy) or prune (the command line).
"""

from __future__ import annotations

import asyncio
import re

from sqlalchemy import delete, select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from tracetap.storage.conversation import Readers
from tracetap.storage.records import CallRecord
from tracetap.storage.search_recompute import texts_of
from tracetap.storage.search_text import call_text
from tracetap.storage.tables import CallText

MAX_WORD = 200  # characters: a longer "word" (base64, a hash) is not looked up by anyone
WORD = re.compile(r"[^\W_]+")  # letters and digits, as SQLite's unicode61 splits
# The words go as one string: a word holds no whitespace (words()), and asyncpg encodes
# a text[] parameter element by element with two abc isinstance checks each (~1 µs a
# word: ~3 ms for a call adding 2,800 words). Sorted, so neighbours share their start
# and TOAST's compression finds it. The index's keys are computed by Postgres (0016).
_PG_INSERT = ("INSERT INTO call_text (call_id, episode_id, words) VALUES ($1, $2, $3) "
              "ON CONFLICT (call_id) DO NOTHING")
_SQLITE_ROWS = 256  # rows per INSERT ... RETURNING (two variables each)
_FTS_INSERT = "INSERT INTO call_text_fts(rowid, body) VALUES (?, ?)"
_FTS_DELETE = text("INSERT INTO call_text_fts(call_text_fts, rowid, body) "
                   "VALUES ('delete', :id, :body)")


def rows_for(records: list[CallRecord],
             readers: Readers | None = None) -> list[tuple[str, str, str]]:
    """(call_id, episode_id, text) for the records of an episode that have text."""
    shapes = Readers() if readers is None else readers
    out = []
    for record in records:
        if record.episode_id is None:
            continue  # the search finds episodes: an untagged call has none to show
        body = call_text(record, shapes)
        if body:
            out.append((record.call_id, record.episode_id, body))
    return out


def words(body: str) -> list[str]:
    """The distinct words of a text, lower case: what Postgres indexes of it. Split at
    whitespace and deduplicated first (C speed), so the regex sees each chunk once."""
    out: set[str] = set()
    for chunk in set(body.lower().split()):
        if chunk.isalnum():
            out.add(chunk)
        else:
            out.update(WORD.findall(chunk))
    return [w for w in out if len(w) <= MAX_WORD]


def _word_rows(records: list[CallRecord],
               readers: Readers | None) -> list[tuple[str, str, str]]:
    return [(c, e, " ".join(sorted(words(body)))) for c, e, body in rows_for(records, readers)]


async def index_calls(raw, dialect: str, records: list[CallRecord],
                      readers: Readers | None = None) -> None:
    """Index the records on the writer's raw connection, inside its transaction
    (asyncpg or aiosqlite). The text is found in a thread (storage.rows._off_loop: it
    grows with what the agent sent)."""
    if dialect == "postgresql":
        rows = await asyncio.to_thread(_word_rows, records, readers)
        if rows:
            await raw.executemany(_PG_INSERT, rows)
        return
    rows = await asyncio.to_thread(rows_for, records, readers)
    if not rows:
        return
    bodies = {c: body for c, _, body in rows}
    added = []
    for start in range(0, len(rows), _SQLITE_ROWS):
        chunk = rows[start:start + _SQLITE_ROWS]
        values = ", ".join(["(?, ?)"] * len(chunk))
        # One trip to aiosqlite's thread, not three (execute, fetch, close): ~70 µs each.
        added += await raw.execute_fetchall(  # only rows new here: a replay adds none
            f"INSERT INTO call_text (call_id, episode_id) VALUES {values} "
            "ON CONFLICT (call_id) DO NOTHING RETURNING id, call_id",
            [v for c, e, _ in chunk for v in (c, e)])
    if added:
        await raw.executemany(_FTS_INSERT, [(rowid, bodies[c]) for rowid, c in added])


async def forget(conn: AsyncConnection, call_ids: list[str],
                 readers: Readers | None = None) -> None:
    """Remove the calls' search rows, and on SQLite their postings first (while the calls,
    their choices and blocks are still stored: the text is recomputed from them, by the
    shapes the writer was given: ``readers``)."""
    if conn.dialect.name == "sqlite":
        mapped = (await conn.execute(select(CallText.id, CallText.call_id).where(
            CallText.call_id.in_(call_ids)))).all()
        if mapped:
            found = await conn.run_sync(texts_of, [c for _, c in mapped], readers)
            postings = [{"id": i, "body": found[c]} for i, c in mapped if c in found]
            if postings:
                await conn.execute(_FTS_DELETE, postings)
    await conn.execute(delete(CallText).where(CallText.call_id.in_(call_ids)))
