"""call_text: the viewer's full-text search (a GIN index on Postgres, FTS5 on SQLite),
backfilled from the calls already stored

Revision ID: 0011
Revises: 0008
Create Date: 2027-02-01 00:00:00.000000

Existing calls keep everything: the backfill reads each call's request, choice texts and
error (inline, or from its blocks since 0007), picks the text storage.search_text picks
for new calls, and inserts it, a page of calls at a time. On Postgres the text's document
(``doc``, its words as a tsvector, storage.search.words) is indexed with GIN after the
backfill, in one pass.
"""

import sqlalchemy as sa
from alembic import op

from tracetap.storage.blocks import join_text, unpack_block, unpack_refs
from tracetap.storage.search import words
from tracetap.storage.search_text import failure, text_of

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

PAGE = 500
_FTS = [
    "CREATE VIRTUAL TABLE call_text_fts USING fts5(body, content='call_text', "
    "content_rowid='id', tokenize='unicode61')",
    "CREATE TRIGGER call_text_ai AFTER INSERT ON call_text BEGIN "
    "INSERT INTO call_text_fts(rowid, body) VALUES (new.id, new.body); END",
    "CREATE TRIGGER call_text_ad AFTER DELETE ON call_text BEGIN "
    "INSERT INTO call_text_fts(call_text_fts, rowid, body) VALUES ('delete', old.id, old.body); "
    "END",
]


def upgrade() -> None:
    bind = op.get_bind()
    postgres = bind.dialect.name == "postgresql"
    op.create_table(
        "call_text",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), sa.Identity(),
                  nullable=False),
        sa.Column("call_id", sa.String(length=36), nullable=False),
        sa.Column("episode_id", sa.String(length=128), nullable=True),
        sa.Column("body", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_call_text")),
        sa.UniqueConstraint("call_id", name=op.f("uq_call_text_call_id")),
    )
    op.create_index(op.f("ix_call_text_episode_id"), "call_text", ["episode_id"])
    if postgres:
        # storage.search.PG_DOCUMENT: the text's words, written by the writer (and the
        # backfill below); stored, so a query walking episodes tests it cheaply.
        op.execute("ALTER TABLE call_text ADD COLUMN doc tsvector")
    else:
        for statement in _FTS:
            op.execute(statement)
    _backfill(bind)
    if postgres:
        op.execute("CREATE INDEX ix_call_text_document ON call_text USING gin (doc)")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP INDEX ix_call_text_document")
    else:
        for name in ("call_text_ad", "call_text_ai"):
            op.execute(f"DROP TRIGGER {name}")
        op.execute("DROP TABLE call_text_fts")
    op.drop_index(op.f("ix_call_text_episode_id"), table_name="call_text")
    op.drop_table("call_text")


_CALLS = sa.table("calls", *(sa.column(c) for c in (
    "call_id", "episode_id", "request", "request_refs", "error", "http_status", "response",
    "response_refs")))
_CHOICES = sa.table("choices", *(sa.column(c) for c in (
    "call_id", "choice_index", "text", "text_refs")))
_CALL_TEXT = sa.table("call_text", *(sa.column(c) for c in ("call_id", "episode_id", "body")))


def _backfill(bind) -> None:
    after = ""
    while True:
        page = bind.execute(
            sa.select(_CALLS).where(_CALLS.c.call_id > after, _CALLS.c.episode_id.is_not(None))
            .order_by(_CALLS.c.call_id).limit(PAGE)).all()
        if not page:
            return
        after = page[-1].call_id
        _insert(bind, _texts(bind, page))


def _texts(bind, page: list) -> list[dict]:
    """The call_text rows of a page of calls (those with any text)."""
    texts: dict[str, list] = {}
    for c in bind.execute(sa.select(_CHOICES).where(
            _CHOICES.c.call_id.in_([r.call_id for r in page]))
            .order_by(_CHOICES.c.call_id, _CHOICES.c.choice_index)):
        texts.setdefault(c.call_id, []).append((c.text, c.text_refs))
    blocks = _blocks(bind, [r.request_refs for r in page]
                     + [r.response_refs for r in page if r.http_status != 200]
                     + [refs for v in texts.values() for _, refs in v])
    rows = []
    for r in page:
        response = None if r.http_status == 200 else _value(r.response, r.response_refs, blocks)
        body = text_of(_value(r.request, r.request_refs, blocks),
                       [_value(t, refs, blocks) for t, refs in texts.get(r.call_id, ())],
                       failure(r.error, r.http_status, response))
        if body:
            rows.append({"call_id": r.call_id, "episode_id": r.episode_id, "body": body})
    return rows


def _insert(bind, rows: list[dict]) -> None:
    if rows and bind.dialect.name == "postgresql":  # with the document the writer gives
        bind.execute(sa.text("INSERT INTO call_text (call_id, episode_id, body, doc) "
                             "VALUES (:call_id, :episode_id, :body, "
                             "array_to_tsvector(CAST(:words AS text[])))"),
                     [{**r, "words": words(r["body"])} for r in rows])
    elif rows:
        bind.execute(_CALL_TEXT.insert(), rows)


def _blocks(bind, refs: list) -> dict[bytes, bytes]:
    wanted = sorted({h for r in refs if r is not None for h, _ in unpack_refs(bytes(r))})
    blocks = sa.table("blocks", sa.column("hash"), sa.column("data"))
    out = {}
    for start in range(0, len(wanted), PAGE):
        for h, data in bind.execute(sa.select(blocks.c.hash, blocks.c.data).where(
                blocks.c.hash.in_(wanted[start:start + PAGE]))):
            out[bytes(h)] = unpack_block(bytes(data))
    return out


def _value(inline, refs, blocks: dict[bytes, bytes]):
    if refs is None:
        return inline
    try:
        return join_text(blocks[h] for h, _ in unpack_refs(bytes(refs)))
    except KeyError:  # a block missing: the call cannot be read whole, nor indexed
        return inline
