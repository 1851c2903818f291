"""call_text: the viewer's full-text search (a GIN index on Postgres, FTS5 on SQLite),
backfilled from the calls already stored

Revision ID: 0011
Revises: 0008
Create Date: 2027-02-01 00:00:00.000000

Existing calls keep everything: the backfill reads each call's request, choice texts and
error (inline, or from its blocks since 0007), picks the text storage.search_text picks
for new calls (storage.search_recompute), and inserts it, a page of calls at a time. On
Postgres the text's document (``doc``, its words as a tsvector,
storage.search_index.words) is indexed with GIN after the backfill, in one pass.
Revision 0012 keeps the words only.
"""

import sqlalchemy as sa
from alembic import op

from tracetap.storage.conversation import Readers, Shape
from tracetap.storage.search_index import words
from tracetap.storage.search_recompute import every_call

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

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


_CALL_TEXT = sa.table("call_text", *(sa.column(c) for c in ("call_id", "episode_id", "body")))


# The request shapes of the three APIs this revision knew, by endpoint: a frozen copy of
# what their packages declare (proxy/apis/<api>/conversation.py), as a migration does not
# import the proxy (nor should it change when an API's declaration does later).
_CHAT = Shape(messages="messages")
_SHAPES = Readers(shapes={
    "chat": _CHAT, "chat.completions": _CHAT, "completions": Shape(prompt="prompt"),
    "responses": Shape(messages="input", head=("instructions",),
                       assistant_types=("function_call", "custom_tool_call")),
    "messages": Shape(messages="messages", head=("system",))})


def _backfill(bind) -> None:
    for page in every_call(bind, _SHAPES):
        _insert(bind, [{"call_id": c, "episode_id": e, "body": body} for c, e, body in page])


def _insert(bind, rows: list[dict]) -> None:
    if rows and bind.dialect.name == "postgresql":  # with the document the writer gives
        bind.execute(sa.text("INSERT INTO call_text (call_id, episode_id, body, doc) "
                             "VALUES (:call_id, :episode_id, :body, "
                             "array_to_tsvector(CAST(:words AS text[])))"),
                     [{**r, "words": words(r["body"])} for r in rows])
    elif rows:
        bind.execute(_CALL_TEXT.insert(), rows)
