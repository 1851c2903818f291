"""call_text keeps each call's words, not its text: the search index made compact

Revision ID: 0012
Revises: 0011
Create Date: 2027-03-01 00:00:00.000000

Revision 0011 stored each call's search text twice over: in ``call_text.body`` and in its
index. The text is recomputable from the stored call (storage.search_recompute), so the
index keeps only which calls hold which words (storage.search_index):

- SQLite: ``call_text`` loses ``body`` and becomes AUTOINCREMENT (its ids are the
  postings' rowids: never reused); ``call_text_fts`` becomes a contentless FTS5 table
  (``content=''``, ``columnsize=0``, ``detail=none``: no text, no positions), filled here
  from the bodies in one statement, then by the writer (no triggers).
- Postgres: ``call_text`` loses ``body``; ``doc`` (the words) and its GIN index stay.
  The column's space is reused as the table is written (``VACUUM FULL call_text`` gives
  it back at once).

Phrases can no longer be checked for adjacency in SQL: a phrase matches a call holding
all of its words (storage.search). The downgrade drops the compact index and runs 0011's
upgrade again, which recomputes every call's text from the stored calls.
"""

from alembic import context, op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

FTS = ("CREATE VIRTUAL TABLE call_text_fts USING fts5(body, content='', columnsize=0, "
       "detail=none, tokenize='unicode61')")


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_column("call_text", "body")
        return
    for name in ("call_text_ad", "call_text_ai"):  # 0011's external-content index
        op.execute(f"DROP TRIGGER {name}")
    op.execute("DROP TABLE call_text_fts")
    op.execute(FTS)
    op.execute("INSERT INTO call_text_fts(rowid, body) SELECT id, body FROM call_text")
    # Recreated (SQLite cannot add AUTOINCREMENT in place), ids kept: they are the rowids.
    with op.batch_alter_table("call_text", recreate="always",
                              table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.drop_column("body")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP INDEX ix_call_text_document")
    else:
        op.execute("DROP TABLE call_text_fts")
    op.drop_index(op.f("ix_call_text_episode_id"), table_name="call_text")
    op.drop_table("call_text")
    # 0011's upgrade: its table, index and triggers, each call's text recomputed.
    context.script.get_revision("0011").module.upgrade()
