"""The compact search index (migration 0012, storage.search_index) on both databases: the
tables after the upgrade and the downgrade, phrases as all their words in one call,
snippets from the text recomputed from the stored call, prune taking the postings with
the calls, and the index turned off (TRACETAP_SEARCH_INDEX=0 / --no-search-index)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer
from alembic import command
from helpers.search_calls import (
    chat,
    conversation,
    index_nothing,
    matching,
)
from sqlalchemy import func, inspect, select, text

from tracetap.migrations import alembic_config, upgrade
from tracetap.proxy.apis.registry import readers
from tracetap.storage import retention, search, search_index
from tracetap.storage.engine import create_engine
from tracetap.storage.rows import insert_calls
from tracetap.storage.search_recompute import texts_of
from tracetap.storage.search_text import call_text
from tracetap.storage.tables import CallText
from tracetap.viewer.access import Access
from tracetap.viewer.app import ViewerConfig, build_viewer

READERS = readers()  # each API's request shape, as the proxy composes them

TOKEN = "t" * 32


def _url(kind: str, tmp_path, request) -> str:
    return f"sqlite:///{tmp_path / 'search.db'}" if kind == "sqlite" \
        else request.getfixturevalue("fresh_postgres")


async def _with_engine(url: str, work):
    engine = create_engine(url)
    try:
        return await work(engine)
    finally:
        await engine.dispose()


def _run(url: str, work):
    return asyncio.run(_with_engine(url, work))


async def _shape(engine) -> dict:
    """call_text's columns, and the full-text index's definition (FTS5 table and
    triggers on SQLite; indexes on Postgres)."""
    async with engine.connect() as conn:
        columns = await conn.run_sync(
            lambda sync: sorted(c["name"] for c in inspect(sync).get_columns("call_text")))
        if engine.dialect.name == "sqlite":
            index = dict((await conn.execute(text(
                "SELECT name, sql FROM sqlite_master WHERE name LIKE 'call_text%' "
                "AND type IN ('table', 'trigger')"))).all())
        else:
            index = dict.fromkeys((await conn.execute(text(
                "SELECT indexname FROM pg_indexes WHERE tablename = 'call_text'"))).scalars())
    return {"columns": columns, "index": index}


async def _old_writer(url: str) -> None:
    """Calls stored before 0011 (no call_text yet): the backfill indexes them."""
    import tracetap.storage.rows as rows
    saved = rows.index_calls
    rows.index_calls = index_nothing
    try:
        await _with_engine(url, lambda engine: insert_calls(engine, [
            *conversation("old", "SegfaultGremlin at 0x0"),
            chat("old-2", "old", [], "", error="upstream refused: quota")], readers=READERS))
    finally:
        rows.index_calls = saved


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_the_upgrade_keeps_words_only_and_the_downgrade_restores_0011(tmp_path, request, kind):
    url = _url(kind, tmp_path, request)
    upgrade(url, "0010")
    asyncio.run(_old_writer(url))
    upgrade(url, "0011")
    before = _run(url, _shape)
    assert "body" in before["columns"]
    upgrade(url)

    compact = _run(url, _shape)
    assert compact["columns"] == sorted(["id", "call_id", "episode_id"] + (
        ["word_keys", "words"] if kind == "postgres" else []))
    if kind == "sqlite":  # contentless, no positions, no triggers; ids never reused
        assert set(compact["index"]) >= {"call_text", "call_text_fts"}
        assert "content=''" in compact["index"]["call_text_fts"]
        assert "detail=none" in compact["index"]["call_text_fts"]
        assert "AUTOINCREMENT" in compact["index"]["call_text"]
        assert not any(n.startswith("call_text_a") for n in compact["index"])  # triggers
    else:
        assert "ix_call_text_word_keys" in compact["index"]

    async def found(engine):
        return [await matching(engine, w) for w in ("segfaultgremlin", "zebracorn", "quota",
                                                    '"gremlin at"', "nosuchword")]
    assert _run(url, found) == [["old"], ["old"], ["old"], [], []]

    command.downgrade(alembic_config(url), "0011")
    restored = _run(url, _shape)
    assert restored["columns"] == before["columns"]
    assert set(restored["index"]) == set(before["index"])

    async def bodies(engine):
        async with engine.connect() as conn:
            return dict((await conn.execute(text("SELECT call_id, body FROM call_text"))).all())
    stored = [*conversation("old", "SegfaultGremlin at 0x0"),
              chat("old-2", "old", [], "", error="upstream refused: quota")]
    records = {r.call_id: r for r in stored}
    assert _run(url, bodies) == {c: call_text(r, READERS) for c, r in records.items()}
    upgrade(url)  # and up again
    assert _run(url, found) == [["old"], ["old"], ["old"], [], []]


@pytest.fixture(params=["sqlite", "postgres"])
def seeded(request, tmp_path) -> str:
    url = _url(request.param, tmp_path, request)
    upgrade(url)

    async def seed(engine):
        await insert_calls(engine, [
            # "alpha beta" in one call as a phrase, "beta ... alpha" apart in another
            chat("p-0", "adjacent", [{"role": "user", "content": "beta first. Then Alpha-Beta "
                                                                   "together"}], "ok"),
            chat("s-0", "split", [{"role": "user", "content": "only alpha here"}], "ok"),
            chat("s-1", "split", [{"role": "user", "content": "only beta here"}], "ok", t=2e9),
            chat("r-0", "reversed", [{"role": "user", "content": "beta then alpha"}], "ok")],
            readers=READERS)
    _run(url, seed)
    return url


def test_a_phrase_is_all_its_words_in_one_call(seeded):
    async def work(engine):
        return (await matching(engine, '"alpha beta"'), await matching(engine, "alpha beta"),
                await search.snippets(engine, search.parse_terms('"alpha beta"'),
                                      ["adjacent", "reversed"], READERS))
    phrase, words, snippets = _run(seeded, work)
    assert phrase == ["adjacent", "reversed"]  # order and adjacency are not checked
    assert words == ["adjacent", "reversed", "split"]  # each word in some call
    # The snippet marks the phrase where the text holds it as written (not the earlier
    # "beta"), and a word where it does not.
    assert snippets["adjacent"].match == "Alpha-Beta"
    assert snippets["adjacent"].before.endswith("Then ")
    assert snippets["reversed"].match == "beta"


def test_snippets_come_from_the_stored_call(seeded):
    async def work(engine):
        async with engine.connect() as conn:
            recomputed = await conn.run_sync(texts_of, ["p-0", "s-0", "s-1", "nosuch"], READERS)
        found = await search.snippets(engine, search.parse_terms("only"), ["split"],
                                      READERS)
        return recomputed, found
    recomputed, found = _run(seeded, work)
    assert set(recomputed) == {"p-0", "s-0", "s-1"}
    assert recomputed["s-0"] == "only alpha here\nok"  # what the writer indexed
    assert found["split"].call_id == "s-0" and found["split"].matches == 2
    assert (found["split"].before, found["split"].match, found["split"].after) == (
        "", "only", " alpha here\nok")


def test_recomputed_text_is_what_the_writer_indexed(db_url):
    records = [*conversation("e", "FileNotFoundError: conftest.py"),
               chat("x", "e", [{"role": "user", "content": "x\x00y"}], "", error="boom")]
    upgrade(db_url)

    async def work(engine):
        await insert_calls(engine, records, readers=READERS)
        async with engine.connect() as conn:
            return await conn.run_sync(texts_of, [r.call_id for r in records], READERS)
    assert _run(db_url, work) == {r.call_id: call_text(r, READERS) for r in records}


async def _postings(engine, word: str) -> list[int]:
    async with engine.connect() as conn:
        return list((await conn.execute(text(
            "SELECT rowid FROM call_text_fts WHERE call_text_fts MATCH :q"),
            {"q": f'"{word}"'})).scalars())


def test_prune_takes_the_postings_with_the_calls(seeded):
    async def work(engine):
        sqlite = engine.dialect.name == "sqlite"
        before = await _postings(engine, "only") if sqlite else None
        async with engine.begin() as conn:
            await retention._delete(conn, ["split"], ["s-0", "s-1"], READERS)
        async with engine.connect() as conn:
            rows = (await conn.execute(select(func.count()).select_from(CallText))).scalar()
        after = await _postings(engine, "only") if sqlite else None
        found = [await matching(engine, w) for w in ("only", "alpha", '"alpha beta"')]
        return sqlite, before, after, rows, found
    sqlite, before, after, rows, found = _run(seeded, work)
    assert rows == 2
    assert found == [[], ["adjacent", "reversed"], ["adjacent", "reversed"]]
    if sqlite:
        assert len(before) == 2 and after == []  # no posting left behind


def test_a_posting_without_its_row_finds_nothing_and_ids_are_not_reused(tmp_path):
    url = f"sqlite:///{tmp_path / 'orphan.db'}"
    upgrade(url)

    async def work(engine):
        await insert_calls(engine, [chat("a-0", "a", [{"role": "user", "content": "kiwi"}], "")],
                           readers=READERS)
        async with engine.begin() as conn:
            top = (await conn.execute(select(func.max(CallText.id)))).scalar()
            # A row gone without its postings (as when its text could not be recomputed)
            await conn.execute(CallText.__table__.delete())
        assert await matching(engine, "kiwi") == []
        await insert_calls(engine, [chat("b-0", "b", [{"role": "user", "content": "fig"}], "")],
                           readers=READERS)
        async with engine.connect() as conn:
            new = (await conn.execute(select(CallText.id))).scalar()
        return top, new, await matching(engine, "kiwi"), await matching(engine, "fig")
    top, new, kiwi, fig = _run(url, work)
    assert new > top  # the stale posting names no row that exists
    assert kiwi == [] and fig == ["b"]


def test_a_journal_replayed_then_pruned_leaves_no_posting(tmp_path):
    url = f"sqlite:///{tmp_path / 'replay.db'}"
    upgrade(url)
    records = conversation("e", "FileNotFoundError: conftest.py")

    async def work(engine):
        await insert_calls(engine, records, readers=READERS)
        # Replayed: the rows exist, no postings added.
        await insert_calls(engine, records, readers=READERS)
        once = await _postings(engine, "zebracorn")
        async with engine.begin() as conn:  # one 'delete' per row takes every posting
            await retention._delete(conn, ["e"], [r.call_id for r in records], READERS)
        return once, await _postings(engine, "zebracorn"), await _postings(engine, "pytest")
    once, after, other = _run(url, work)
    assert len(once) == 1 and after == [] and other == []


def test_the_index_turned_off_writes_no_rows(db_url):
    upgrade(db_url)

    async def work(engine):
        await insert_calls(engine, conversation("e", "No space left"), search_index=False,
                           readers=READERS)
        async with engine.connect() as conn:
            rows = (await conn.execute(select(func.count()).select_from(CallText))).scalar()
        return rows, await matching(engine, "zebracorn")
    assert _run(db_url, work) == (0, [])


def test_the_setting_is_read_from_the_flag_and_the_variable(monkeypatch):
    from tracetap.cli import build_parser
    from tracetap.proxy.server.serve_flags import settings_from_args

    monkeypatch.delenv("TRACETAP_SEARCH_INDEX", raising=False)
    serve = ["serve", "--upstream", "http://127.0.0.1:9/v1"]
    assert settings_from_args(build_parser().parse_args(serve)).search_index is True
    off = build_parser().parse_args([*serve, "--no-search-index"])
    assert settings_from_args(off).search_index is False
    assert build_parser().parse_args(["ui", "--no-search-index"]).search_index is False
    monkeypatch.setenv("TRACETAP_SEARCH_INDEX", "0")
    assert settings_from_args(build_parser().parse_args(serve)).search_index is False
    assert build_parser().parse_args(["ui"]).search_index is False


def test_the_writer_turned_off_indexes_nothing(tmp_path):
    from tracetap.storage.journal import Journal
    from tracetap.storage.writer import Writer

    url = f"sqlite:///{tmp_path / 'writer.db'}"
    upgrade(url)

    async def work(engine):
        counts = []
        for on in (False, True):
            journal = Journal(tmp_path / f"journal-{on}", max_bytes=1 << 20)
            writer = Writer(engine, journal, search_index=on, readers=READERS)
            writer.start()
            for record in conversation(f"e-{on}", "No space left"):
                writer.submit(record)
            while writer.pending:
                await asyncio.sleep(0.01)
            await writer.close()
            async with engine.connect() as conn:
                counts.append((await conn.execute(
                    select(func.count()).select_from(CallText))).scalar())
        return counts
    assert _run(url, work) == [0, 2]


def test_the_search_page_says_the_index_is_off_and_finds_ids(tmp_path):
    url = f"sqlite:///{tmp_path / 'off.db'}"
    upgrade(url)

    async def work():
        await _with_engine(url, lambda engine: insert_calls(
            engine, [*conversation("ep-alpha", "zebra"), *conversation("ep-beta", "zebra")],
            search_index=False, readers=READERS))
        pages = {}
        for indexed in (False, True):
            app = build_viewer(ViewerConfig(database_url=url, search_index=indexed),
                               Access(lambda _request: TOKEN), readers(), mounted=False)
            async with TestClient(TestServer(app)) as client:
                response = await client.get("/tracetap/ui/search", params={"q": "alpha"},
                                            headers={"Authorization": f"Bearer {TOKEN}"})
                pages[indexed] = (response.status, await response.text())
        return pages
    pages = asyncio.run(work())
    status, off = pages[False]
    assert status == 200 and "The full-text index is off" in off
    assert "/episodes/ep-alpha" in off and "/episodes/ep-beta" not in off  # by id
    status, on = pages[True]
    assert status == 200 and "The full-text index is off" not in on
    assert "No episode matches" in on  # nothing was indexed, and ids are not text


def test_words_are_indexed_lower_case_and_bounded():
    assert sorted(search_index.words("Foo foo conftest.py " + "x" * 201)) == [
        "conftest", "foo", "py"]


def test_postgres_stores_exactly_the_words_of_the_text(fresh_postgres):
    """The words travel to Postgres as one string that it splits: every word arrives
    whole (unicode, digits, a word at the length bound), none is made up of a separator,
    and a text with no word at all stores none."""
    tricky = ("Grüße Ünïcode naïve 42 x2y\tTab\nnew\u00a0nbsp\u2003em_space a-b c.d "
              + "y" * 200 + " " + "z" * 201 + " \"quoted\" back\\slash 'tick' colon:1")
    calls = [chat("c-words", "ep-words", [{"role": "user", "content": tricky}], "Antwort"),
             chat("c-none", "ep-words", [{"role": "user", "content": "... !!! ---"}], "?")]
    upgrade(fresh_postgres)

    async def work(engine):
        await insert_calls(engine, calls, search_index=True, readers=READERS)
        async with engine.connect() as conn:
            return dict((await conn.execute(text(
                "SELECT call_id, string_to_array(words, ' ') FROM call_text"))).all())
    stored = _run(fresh_postgres, work)
    expected = search_index.words(call_text(calls[0], READERS))
    assert "grüße" in expected and "nbsp" in expected and "y" * 200 in expected
    assert sorted(stored["c-words"]) == sorted(expected)
    assert stored["c-none"] == []
