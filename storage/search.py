"""Full-text search over what calls said: the viewer's query, and its snippets.

The index (storage.search_index, migrations 0012, 0016) holds each call's words, not its
text: on Postgres the words as text with a GIN index of their hash buckets (no stemming:
tool output, code and error names are matched as written, case-insensitively), on SQLite
a contentless FTS5 table (``unicode61``, ``detail=none``). Both read the same query
syntax: words (all must occur, each in any call of the episode), ``"quoted phrases"`` (all
of the phrase's words in one call: neither index keeps where a word is, so the words'
order and adjacency are not checked) and ``-excluded`` words (in none of its calls). Every search
goes through ``call_text``: a call pruned is found by nothing, whatever postings remain.
A term given twice counts once, a word twice in a term once, and a search of more than
MAX_WORDS different words or MAX_TERMS terms is refused (TooManyWords): each term costs a
read of its postings (a phrase's words are read together, as one), and the viewer runs
searches on a bounded pool (storage.search_pool).

A snippet is made from the call's text recomputed from what it stored
(storage.search_recompute), for the first matching call of each episode on the page; it
marks the phrase where the text holds it as written, else the first of its words. The
text has its credentials hidden first (storage.credentials), so a snippet never shows one,
not even when it is what was searched for.
"""

from __future__ import annotations

import re
from collections import Counter

import msgspec
from sqlalchemy import (
    String,
    Text,
    any_,
    bindparam,
    cast,
    exists,
    func,
    literal_column,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.storage.conversation import Readers
from tracetap.storage.credentials import mask_text
from tracetap.storage.search_index import WORD as _WORD
from tracetap.storage.search_recompute import texts_of
from tracetap.storage.tables import Call, CallText, Episode

# Postgres's index of a call's words (migration 0016): ``call_text.words``, its distinct
# words, lower case, as the writer found them (storage.search_index.words: letters and
# digits, as SQLite's unicode61 splits), space-separated; and a GIN index of
# ``word_keys``, generated from them by ``tracetap_word_keys``: each word's hash bucket (a
# GIN keyed by the words themselves took 14-20 bytes per unique token on rare words: an
# entry per distinct word).
# A term reads the calls holding its words' buckets from the index, then keeps those whose
# words hold each of its words as written: exact, whatever words share a bucket.
# Postgres's own parser (to_tsvector) cost a millisecond and more per call in the
# database and halved the writer's throughput (bench/writer_bench.py); it also reads
# ``conftest.py`` as one word.
PG_WORDS = "call_text.words"
PG_KEYS = "call_text.word_keys"
SNIPPET = 160  # characters of context around the first match
FEW = 10_000  # calls a term may match and still be looked up first (resolved_conditions)
_TERMS = re.compile(r'(-?)"([^"]*)"|(-?)(\S+)')
MAX_WORDS = 16  # different words in one search
MAX_TERMS = 8  # words and phrases, wanted or not: 8 common ones take ~1 s at 50,000 episodes


class TooManyWords(ValueError):
    """A search of more different words than MAX_WORDS; the message says what to do."""


class Terms(msgspec.Struct, frozen=True):
    """A search box's text: words and phrases that must occur, words that must not."""

    wanted: tuple[str, ...]
    unwanted: tuple[str, ...] = ()

    @property
    def words(self) -> list[str]:
        """The words a snippet looks for (lower case)."""
        return [w.lower() for t in self.wanted for w in _WORD.findall(t)]


def parse_terms(query: str) -> Terms | None:
    wanted, unwanted, seen, words = [], [], set(), set()
    for m in _TERMS.finditer(query):
        negative, term = (m.group(1), m.group(2)) if m.group(2) is not None \
            else (m.group(3), m.group(4))
        found = tuple(dict.fromkeys(w.lower() for w in _WORD.findall(term or "")))
        if not found:
            continue  # punctuation alone matches nothing in either index
        if (negative, found) in seen:
            continue  # the same term again finds the same episodes
        seen.add((negative, found))
        words.update(found)
        (unwanted if negative else wanted).append(term)
    if len(words) > MAX_WORDS:
        raise TooManyWords(
            f"the search has {len(words)} different words; at most {MAX_WORDS} are looked "
            "up. Keep the rarest (an error's name, a path, an id): a common word narrows "
            "little and costs the most")
    if len(wanted) + len(unwanted) > MAX_TERMS:
        raise TooManyWords(
            f"the search has {len(wanted) + len(unwanted)} terms; at most {MAX_TERMS} are "
            "looked up. Quote words that belong together (\"connection reset by peer\" is "
            "one term) or keep the rarest")
    return Terms(tuple(wanted), tuple(unwanted)) if wanted else None


def _pg_words(term: str) -> list[str]:
    return list(dict.fromkeys(_WORD.findall(term.lower())))


def _pg_keys(found: list[str]) -> str:
    """Calls whose keys hold those of all of ``found`` (what the index answers)."""
    return f"{PG_KEYS} @> tracetap_word_keys('{' '.join(found)}')"


def _pg_condition(term: str) -> str:
    """One term as SQL over call_text: all of its words, by their buckets (the index),
    then each as a whole word of the call's words. SQL text, not parameters: a statement
    prepared with parameters is planned generically after five runs, for any word, and
    that plan read every call's words (a seq scan, 30-50 ms at 60,000 calls) where the
    index finds a rare word in 2. Safe: a word holds only letters and digits."""
    found = _pg_words(term)
    if not found:
        return "false"
    # "<> 0", not "> 0": the planner guesses 0.995 of rows pass an unknown "<>" and a
    # third an unknown ">", so the estimate stays the keys' (about the matches); a third
    # per word made it plan a common word's episodes as if they were few.
    exact = " AND ".join(f"strpos(' ' || {PG_WORDS} || ' ', ' {w} ') <> 0" for w in found)
    return f"({_pg_keys(found)} AND {exact})"


def _fts_query(term: str) -> str:
    """One term in FTS5's syntax: all of its words, each quoted (a plain word whatever it
    spells; a quoted string of several tokens is a phrase, which detail=none refuses)."""
    return "(" + " AND ".join('"' + w + '"' for w in dict.fromkeys(
        _WORD.findall(term.lower()))) + ")"


def matching_calls(dialect: str, term: str | list[str]):
    """SELECT of call_text rows whose call holds ``term`` (or any of a list): all of
    the term's words."""
    terms = [term] if isinstance(term, str) else term
    if dialect == "postgresql":
        # Parenthesised: a caller adds its own conditions, which must hold for every term.
        return select(CallText).where(
            text("(" + " OR ".join(_pg_condition(t) for t in terms) + ")"))
    fts = text("SELECT rowid FROM call_text_fts WHERE call_text_fts MATCH :search_q"
               ).bindparams(_unique(" OR ".join(_fts_query(t) for t in terms)))
    return select(CallText).where(CallText.id.in_(fts))


def _unique(value: str):
    # A statement with several terms holds several of these: each its own parameter.
    return bindparam("search_q", value, unique=True)


def _having(dialect: str, term: str):
    return Episode.id.in_(matching_calls(dialect, term).with_only_columns(CallText.episode_id))


async def _estimate(conn, term: str) -> float:
    """The planner's estimate of the calls holding ``term``'s keys (from the column's
    statistics: a millisecond, where reading a common word's 300,000 postings costs a
    hundred). The keys only: the planner guesses a third for each word's exact test."""
    found = _pg_words(term) or [""]
    plan = (await conn.execute(text(
        f"EXPLAIN (FORMAT JSON) SELECT 1 FROM call_text WHERE {_pg_keys(found)}"))).scalar()
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
            # The limit a literal too (matching_calls: no parameter, so no generic plan).
            found = (await conn.execute(matching_calls(dialect, term).with_only_columns(
                CallText.episode_id).limit(literal_column(str(FEW + 1))))).scalars().all()
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


async def snippets(engine: AsyncEngine, terms: Terms, episode_ids: list[str],
                   readers: Readers | None = None) -> dict[str, Snippet]:
    """For each episode, its first matching call, the words around the first match and
    how many of its calls match. The text is recomputed for those first calls only (at
    most a page of them), by the request shapes the writer was given (``readers``)."""
    if not episode_ids:
        return {}
    query = matching_calls(engine.dialect.name, list(terms.wanted)).with_only_columns(
        CallText.episode_id, CallText.call_id
    ).where(CallText.episode_id.in_(episode_ids)).order_by(CallText.id)
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
        first: dict[str, str] = {}
        for episode_id, call_id in rows:
            first.setdefault(episode_id, call_id)
        found = await conn.run_sync(texts_of, list(first.values()), readers)
    matches = Counter(episode_id for episode_id, _ in rows)
    marks = _marks(terms)
    return {episode_id: Snippet(call_id=call_id, matches=matches[episode_id],
                                **_around(mask_text(found.get(call_id, "")), marks))
            for episode_id, call_id in first.items()}


def _marks(terms: Terms) -> list[re.Pattern]:
    """What a snippet marks, in order of preference: a phrase's words as written (in this
    order, apart only by what is not a word), then any wanted word; whole words, any case."""
    def whole(pattern: str) -> re.Pattern:
        return re.compile(r"(?<![^\W_])(?:" + pattern + r")(?![^\W_])", re.IGNORECASE)

    phrases = [found for t in terms.wanted if len(found := _WORD.findall(t)) > 1]
    # The longest first, where one word starts another.
    every = sorted(set(terms.words), key=len, reverse=True)
    return [*(whole(r"[\W_]+".join(map(re.escape, p))) for p in phrases),
            whole("|".join(map(re.escape, every)))]


def _around(body: str, marks: list[re.Pattern]) -> dict[str, str]:
    hit = None
    for pattern in marks[:-1]:  # phrases: the earliest of those the text holds
        m = pattern.search(body)
        if m and (hit is None or m.start() < hit.start()):
            hit = m
    hit = hit or marks[-1].search(body)
    if hit is None:
        return {"before": "", "match": "", "after": body[:SNIPPET]}
    at, end = hit.span()
    start = max(0, at - SNIPPET // 2)
    return {"before": ("…" if start else "") + body[start:at], "match": body[at:end],
            "after": body[end:end + SNIPPET // 2] + ("…" if end + SNIPPET // 2 < len(body)
                                                      else "")}
