"""Postgres's search index keyed by word hash buckets, the words kept as text

Revision ID: 0016_word_keys
Revises: 0015_annotations
Create Date: 2026-12-07 09:00:00.000000

Postgres only (SQLite's FTS5 index is unchanged). Since 0011 ``call_text.doc`` held a
call's words as a tsvector with a GIN index of every word: on text whose words are rare
(tool output, ids, hashes) the GIN holds one entry per distinct word, ~36 bytes each on
half-full pages, and its pending list (``fastupdate``) doubles what was written; with the
tsvector that was 33 bytes per unique token of the agentic replay
(bench/storage_bytes.py), three times what the calls themselves take.

Now ``call_text.words`` holds the call's distinct words as text (space-separated:
storage.search_index.words, sorted, TOAST-compressed), and ``word_keys`` (generated from
them by ``tracetap_word_keys``) each word's ``hashtext`` folded to one of KEYS buckets,
GIN-indexed: the index has at most KEYS entries, written in place (``fastupdate = off``:
its pending list held up to 4 MB more than the index). A search reads the candidates of
its words' buckets from the index and keeps those whose words hold each word exactly
(storage.search): no false match, whatever collides. The keys are stored, not an index
expression: a search for a common word scans the table, and recomputing every row's keys
there cost 8 µs a row where comparing stored keys costs nothing.

The upgrade writes each row's words from its tsvector (the same words: the writer gave
them), drops ``doc`` and its index, adds the keys (which rewrites the table: the old rows'
space is given back) and builds the index, in one transaction: 3.7 s for the agentic
replay's 240 calls of ~2,800 new words each (19.1 MB of ``call_text`` before, 8.0 MB
after), 18 s for 960. The downgrade rebuilds the tsvector from the words.
"""

from alembic import op

revision = "0016_word_keys"
down_revision = "0015_annotations"
branch_labels = None
depends_on = None

KEYS = 32768  # buckets (a power of two, at most int2's): storage.search reads the same
# IMMUTABLE, as a generated column's expression must be: hashtext is (hash indexes rely on
# it). Its body names only pg_catalog functions, which every search_path resolves first.
# Sorted, so TOAST's compression finds what neighbours share.
FUNCTION = f"""
CREATE FUNCTION tracetap_word_keys(words text) RETURNS int2[]
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
  SELECT array(SELECT DISTINCT (hashtext(w) & {KEYS - 1})::int2
               FROM unnest(string_to_array(words, ' ')) w WHERE w <> '' ORDER BY 1)
$$"""
KEYS_COLUMN = ("ALTER TABLE call_text ADD COLUMN word_keys int2[] "
               "GENERATED ALWAYS AS (tracetap_word_keys(words)) STORED")
INDEX = ("CREATE INDEX ix_call_text_word_keys ON call_text USING gin (word_keys) "
         "WITH (fastupdate = off)")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(FUNCTION)
    op.execute("ALTER TABLE call_text ADD COLUMN words text")
    op.execute("UPDATE call_text SET words = array_to_string(tsvector_to_array(doc), ' ')")
    op.execute("DROP INDEX ix_call_text_document")
    op.execute("ALTER TABLE call_text DROP COLUMN doc")
    op.execute(KEYS_COLUMN)
    op.execute(INDEX)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("ALTER TABLE call_text ADD COLUMN doc tsvector")
    op.execute("UPDATE call_text SET doc = array_to_tsvector(string_to_array(words, ' '))")
    op.execute("DROP INDEX ix_call_text_word_keys")
    op.execute("ALTER TABLE call_text DROP COLUMN word_keys")
    op.execute("ALTER TABLE call_text DROP COLUMN words")
    op.execute("DROP FUNCTION tracetap_word_keys(text)")
    op.execute("CREATE INDEX ix_call_text_document ON call_text USING gin (doc)")
