"""Postgres's search index keyed by word hash buckets (migration 0016, storage.search): a
populated 0015 database upgraded and searched, the downgrade giving 0015's tsvector back,
and a word that shares its bucket with a word a call holds finding nothing there."""

from __future__ import annotations

import asyncio

from alembic import command
from helpers.search_calls import conversation, index_nothing, matching
from sqlalchemy import text

import tracetap.storage.rows as rows
from tracetap.migrations import alembic_config, upgrade
from tracetap.proxy.apis.registry import readers
from tracetap.storage import search, search_index
from tracetap.storage.engine import create_engine
from tracetap.storage.rows import insert_calls
from tracetap.storage.search_text import call_text

READERS = readers()
CALLS = [*conversation("ep-gremlin", "SegfaultGremlin at 0x0"),
         *conversation("ep-quota", "upstream refused: quota exceeded")]
SEARCHES = ("segfaultgremlin", "zebracorn", "quota", '"refused quota"', "zebracorn -quota",
            "nosuchword")
FOUND = [["ep-gremlin"], ["ep-gremlin", "ep-quota"], ["ep-quota"], ["ep-quota"],
         ["ep-gremlin"], []]


def _run(url: str, work):
    async def run():
        engine = create_engine(url)
        try:
            return await work(engine)
        finally:
            await engine.dispose()
    return asyncio.run(run())


async def _as_0015_wrote(engine) -> None:
    """The calls, and their search rows as the writer of 0015 wrote them: a tsvector."""
    saved = rows.index_calls
    rows.index_calls = index_nothing
    try:
        await insert_calls(engine, CALLS, readers=READERS)
    finally:
        rows.index_calls = saved
    async with engine.begin() as conn:
        await conn.execute(text(
            "INSERT INTO call_text (call_id, episode_id, doc) VALUES "
            "(:c, :e, array_to_tsvector(string_to_array(:w, ' ')))"),
            [{"c": r.call_id, "e": r.episode_id,
              "w": " ".join(search_index.words(call_text(r, READERS)))} for r in CALLS])


async def _searches(engine) -> list[list[str]]:
    return [await matching(engine, s) for s in SEARCHES]


async def _stored(engine, column: str) -> dict[str, list[str]]:
    async with engine.connect() as conn:
        return {c: sorted(w) for c, w in (await conn.execute(text(
            f"SELECT call_id, {column} FROM call_text"))).all()}


def test_a_populated_0015_database_upgrades_searches_and_downgrades(fresh_postgres):
    url = fresh_postgres
    upgrade(url, "0015_annotations")
    _run(url, _as_0015_wrote)
    before = _run(url, lambda e: _stored(e, "tsvector_to_array(doc)"))
    upgrade(url)

    assert _run(url, lambda e: _stored(e, "string_to_array(words, ' ')")) == before
    assert _run(url, _searches) == FOUND

    command.downgrade(alembic_config(url), "0015_annotations")
    assert _run(url, lambda e: _stored(e, "tsvector_to_array(doc)")) == before
    upgrade(url)  # and up again
    assert _run(url, _searches) == FOUND


async def _bucket_mate(engine, word: str) -> str:
    """A word that is not ``word`` and shares its bucket."""
    async with engine.connect() as conn:
        return (await conn.execute(text(
            "SELECT w FROM (SELECT 'x' || n AS w FROM generate_series(1, 1000000) n) t "
            "WHERE tracetap_word_keys(w) = tracetap_word_keys(:word) AND w <> :word "
            "LIMIT 1"), {"word": word})).scalar_one()


def test_a_word_sharing_a_bucket_finds_nothing(fresh_postgres):
    url = fresh_postgres
    upgrade(url)

    async def work(engine):
        await insert_calls(engine, CALLS, readers=READERS, search_index=True)
        mate = await _bucket_mate(engine, "segfaultgremlin")
        async with engine.connect() as conn:  # the index alone would find it
            assert (await conn.execute(text(
                "SELECT count(*) FROM call_text WHERE word_keys @> tracetap_word_keys(:w)"),
                {"w": mate})).scalar_one() > 0
        return [await matching(engine, s) for s in (
            mate, f"segfaultgremlin {mate}", f'"{mate} segfaultgremlin"', f"zebracorn -{mate}",
            "segfaultgremlin")]
    assert _run(url, work) == [[], [], [], ["ep-gremlin", "ep-quota"], ["ep-gremlin"]]


def test_snippets_of_several_terms_keep_to_the_episodes_asked(fresh_postgres):
    """The terms' conditions are one clause: the episodes asked for hold for every term
    (an OR left bare would read the first term's calls in every episode)."""
    url = fresh_postgres
    upgrade(url)

    async def work(engine):
        await insert_calls(engine, CALLS, readers=READERS, search_index=True)
        terms = search.parse_terms("zebracorn quota")
        return {e: s.matches for e, s in (
            await search.snippets(engine, terms, ["ep-quota"], READERS)).items()}
    assert _run(url, work) == {"ep-quota": 2}
