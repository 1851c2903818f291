"""Full-text search over what calls said: the writer's index rows, and the viewer's query.

The writer adds one ``call_text`` row per call of an episode in its batch's transaction
(``index_calls``, from storage.rows): the text storage.search_text picks, so replaying a
journal indexes once (the row is keyed by call id) and a refused batch indexes nothing.
Postgres indexes it with a GIN index of its words (``doc``, a tsvector; no stemming:
tool output, code and error names are matched as written, case-insensitively); SQLite
with an FTS5 table (``unicode61``). Both read the same query syntax: words (all must
occur, each in any call of the episode), ``"quoted phrases"`` (in one call) and
``-excluded`` words (in none of its calls).
"""

from __future__ import annotations

import re

import msgspec
from sqlalchemy import String, Text, any_, bindparam, cast, exists, func, select, text
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.storage.records import CallRecord
from tracetap.storage.search_text import call_text
from tracetap.storage.tables import Call, CallText, Episode

_PG_INSERT = ("INSERT INTO call_text (call_id, episode_id, body, doc) "
              "VALUES ($1, $2, $3, array_to_tsvector($4::text[])) "
              "ON CONFLICT (call_id) DO NOTHING")
_SQLITE_INSERT = ("INSERT INTO call_text (call_id, episode_id, body) VALUES (?, ?, ?) "
                  "ON CONFLICT (call_id) DO NOTHING")
# Postgres's document of a call's text (migration 0011): its distinct words, lower case,
# as the writer found them (``words``: letters and digits, as SQLite's unicode61 splits),
# made a tsvector by array_to_tsvector. Postgres's own parser (to_tsvector) cost a
# millisecond and more per call in the database and halved the writer's throughput
# (bench/writer_bench.py); it also reads ``conftest.py`` as one word. Without positions a
# phrase is its words in the document, then the phrase in the text (``_phrase``).
PG_DOCUMENT = "call_text.doc"
MAX_WORD = 200  # characters: a longer "word" (base64, a hash) is not looked up by anyone
SNIPPET = 160  # characters of context around the first match
FEW = 10_000  # calls a term may match and still be looked up first (resolved_conditions)
_SNIPPET_READ = 20_000  # characters of a matching call read for its snippet
_TERMS = re.compile(r'(-?)"([^"]*)"|(-?)(\S+)')
_WORD = re.compile(r"[^\W_]+")


def rows_for(records: list[CallRecord]) -> list[tuple[str, str | None, str]]:
    """(call_id, episode_id, text) for the records of an episode that have text."""
    out = []
    for record in records:
        if record.episode_id is None:
            continue  # the search finds episodes: an untagged call has none to show
        body = call_text(record)
        if body:
            out.append((record.call_id, record.episode_id, body))
    return out


async def index_calls(raw, dialect: str, records: list[CallRecord]) -> None:
    """Insert the records' search rows on the writer's raw connection, inside its
    transaction (asyncpg or aiosqlite)."""
    rows = rows_for(records)
    if not rows:
        return
    if dialect == "postgresql":
        await raw.executemany(_PG_INSERT, [(*row, words(row[2])) for row in rows])
    else:
        await raw.executemany(_SQLITE_INSERT, rows)


class Terms(msgspec.Struct, frozen=True):
    """A search box's text: words and phrases that must occur, words that must not."""

    wanted: tuple[str, ...]
    unwanted: tuple[str, ...] = ()

    @property
    def words(self) -> list[str]:
        """The words a snippet looks for (lower case)."""
        return [w.lower() for t in self.wanted for w in _WORD.findall(t)]


def parse_terms(query: str) -> Terms | None:
    wanted, unwanted = [], []
    for m in _TERMS.finditer(query):
        negative, term = (m.group(1), m.group(2)) if m.group(2) is not None \
            else (m.group(3), m.group(4))
        if not _WORD.search(term or ""):
            continue  # punctuation alone matches nothing in either index
        (unwanted if negative else wanted).append(term)
    return Terms(tuple(wanted), tuple(unwanted)) if wanted else None


def words(text: str) -> list[str]:
    """The distinct words of a text, lower case: what Postgres indexes of it. Split at
    whitespace and deduplicated first (C speed), so the regex sees each chunk once."""
    out: set[str] = set()
    for chunk in set(text.lower().split()):
        if chunk.isalnum():
            out.add(chunk)
        else:
            out.update(_WORD.findall(chunk))
    return [w for w in out if len(w) <= MAX_WORD]


def _pg_query(term: str) -> str:
    """One term as a tsquery literal: all of its words (quoted, so any is a plain word)."""
    return " & ".join("'" + w + "'" for w in _WORD.findall(term.lower())) or "''"


def _phrase(term: str):
    """A phrase's words in this order, in the text (the document has no positions)."""
    found = _WORD.findall(term.lower())
    if len(found) < 2:
        return None
    pattern = r"\m" + "[^[:alnum:]]+".join(found) + r"\M"  # \W is not allowed in [ ]
    return CallText.body.op("~*")(bindparam("phrase", pattern, unique=True))


def _fts_query(term: str) -> str:
    """One term in FTS5's syntax: a quoted string (quotes doubled)."""
    return '"' + term.replace('"', '""') + '"'


def matching_calls(dialect: str, term: str | list[str]):
    """SELECT of call_text rows whose body holds ``term`` (or any of a list)."""
    terms = [term] if isinstance(term, str) else term
    if dialect == "postgresql":
        query = select(CallText).where(text(f"{PG_DOCUMENT} @@ CAST(:search_q AS tsquery)")
                                       .bindparams(_unique(" | ".join(
                                           f"({_pg_query(t)})" for t in terms))))
        phrases = [p for t in terms if (p := _phrase(t)) is not None]
        if len(terms) == 1 and phrases:
            query = query.where(phrases[0])
        return query
    fts = text("SELECT rowid FROM call_text_fts WHERE call_text_fts MATCH :search_q"
               ).bindparams(_unique(" OR ".join(_fts_query(t) for t in terms)))
    return select(CallText).where(CallText.id.in_(fts))


def _unique(value: str):
    # A statement with several terms holds several of these: each its own parameter.
    return bindparam("search_q", value, unique=True)


def _having(dialect: str, term: str):
    return Episode.id.in_(matching_calls(dialect, term).with_only_columns(CallText.episode_id))


async def _estimate(conn, term: str) -> float:
    """The planner's estimate of the calls holding ``term`` (from the column's statistics:
    a millisecond, where reading a common word's 300,000 postings costs a hundred)."""
    plan = (await conn.execute(text(
        f"EXPLAIN (FORMAT JSON) SELECT 1 FROM call_text WHERE {PG_DOCUMENT} @@ "
        "CAST(:search_q AS tsquery)"), {"search_q": _pg_query(term)})).scalar()
    decoded = msgspec.json.decode(plan) if isinstance(plan, (str, bytes)) else plan
    return float(decoded[0]["Plan"]["Plan Rows"])


def _among(dialect: str, ids: list[str]):
    """Episode.id in ``ids``: on Postgres one array parameter (= ANY), not thousands of
    parameters in a statement prepared anew for each length."""
    if dialect == "postgresql":
        return Episode.id == any_(bindparam("among", ids, type_=ARRAY(String), unique=True))
    return Episode.id.in_(ids)


def _lacking(dialect: str, term: str):
    # NOT EXISTS, not NOT IN: an anti-join; NOT IN over a common word's 300,000 calls
    # ran its subquery per episode.
    return ~matching_calls(dialect, term).where(CallText.episode_id == Episode.id).exists()


def text_conditions(dialect: str, terms: Terms) -> list:
    """Episodes where each wanted term occurs (in any of their calls), and no unwanted
    one does."""
    return [*(_having(dialect, t) for t in terms.wanted),
            *(_lacking(dialect, t) for t in terms.unwanted)]


async def resolved_conditions(engine: AsyncEngine, terms: Terms) -> list:
    """text_conditions, with each wanted term in at most FEW calls replaced by the list of
    its episodes, read through the full-text index first. Left to itself the planner
    walks episodes newest first testing each one's calls, which finds a common word's
    50 newest episodes in a millisecond but a rare word's in seconds (100,000 episodes)."""
    dialect = engine.dialect.name
    out = []
    async with engine.connect() as conn:
        for term in terms.wanted:
            if dialect == "postgresql" and await _estimate(conn, term) > FEW:
                out.append(_having(dialect, term))  # common: reading its calls costs more
                continue
            found = (await conn.execute(matching_calls(dialect, term).with_only_columns(
                CallText.episode_id).limit(FEW + 1))).scalars().all()
            out.append(_among(dialect, sorted(set(found))) if len(found) <= FEW
                       else _having(dialect, term))
    return [*out, *(_lacking(dialect, t) for t in terms.unwanted)]


def call_condition(column, value: str):
    """Episodes with a call whose ``column`` (model, policy_version) is ``value``."""
    return exists().where(Call.episode_id == Episode.id, column == value)


def json_condition(dialect: str, column, key: str, value: str):
    """Episodes whose JSON ``column`` has ``key`` at ``value``, spelt as a factor level
    (exporters.factors: strings as they are, numbers, booleans and null as JSON)."""
    if dialect == "postgresql":
        found = func.jsonb_extract_path_text(cast(column, JSONB), key)
    else:
        path = '$."' + key + '"'
        kind = func.json_type(column, path)
        found = func.iif(kind.in_(("true", "false")), kind,
                         cast(func.json_extract(column, path), Text))
    return found.is_(None) if value == "null" else found == value


class Snippet(msgspec.Struct, kw_only=True):
    call_id: str
    before: str
    match: str
    after: str
    matches: int  # calls of the episode that match


async def snippets(engine: AsyncEngine, terms: Terms,
                   episode_ids: list[str]) -> dict[str, Snippet]:
    """For each episode, its first matching call, the words around the first match and
    how many of its calls match."""
    if not episode_ids:
        return {}
    query = matching_calls(engine.dialect.name, list(terms.wanted)).with_only_columns(
        CallText.episode_id, CallText.call_id, func.substr(CallText.body, 1, _SNIPPET_READ)
    ).where(CallText.episode_id.in_(episode_ids)).order_by(CallText.id)
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    out: dict[str, Snippet] = {}
    for episode_id, call_id, body in rows:
        if episode_id in out:
            out[episode_id].matches += 1
            continue
        out[episode_id] = Snippet(call_id=call_id, matches=1, **_around(body, terms.words))
    return out


def _around(body: str, words: list[str]) -> dict[str, str]:
    lower = body.lower()
    hits = [(at, w) for w in words if (at := lower.find(w)) >= 0]
    if not hits:
        return {"before": "", "match": "", "after": body[:SNIPPET]}
    at, word = min(hits)
    start = max(0, at - SNIPPET // 2)
    end = at + len(word)
    return {"before": ("…" if start else "") + body[start:at], "match": body[at:end],
            "after": body[end:end + SNIPPET // 2] + ("…" if end + SNIPPET // 2 < len(body)
                                                      else "")}
