"""The viewer's search cannot be made to run away: words deduplicated and capped, each
statement bounded in the database (Postgres statement_timeout, SQLite a progress handler),
the search cancelled in Postgres when its client leaves, and a pool of its own that
refuses a search rather than queueing it, while the other pages still answer.

A search is made slow for real: another connection holds call_text's ACCESS EXCLUSIVE
lock, so the search's first statement waits in Postgres until it is stopped."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import aiohttp
import asyncpg
import pytest
from aiohttp import web
from helpers.search_calls import conversation
from sqlalchemy import text

from tracetap.proxy.apis.registry import readers
from tracetap.storage import queries, search
from tracetap.storage.rows import insert_calls
from tracetap.storage.search_pool import SearchBounds, search_engine
from tracetap.viewer import PREFIX
from tracetap.viewer.access import Access
from tracetap.viewer.app import ViewerConfig, build_viewer

TOKEN = "bounds-test-token"
WAITING = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
           "AND state = 'active' AND query ILIKE '%call_text%' AND pid <> pg_backend_pid()")


def test_words_are_deduplicated_and_capped():
    terms = search.parse_terms(" ".join(["Zebracorn"] * 64) + ' "a b a" "A B" -x -x')
    assert terms.wanted == ("Zebracorn", "a b a") and terms.unwanted == ("x",)
    condition = search._pg_condition("a b A")
    assert "tracetap_word_keys('a b')" in condition and condition.count("strpos") == 2
    many = " ".join(f"w{k}" for k in range(search.MAX_WORDS + 1))
    with pytest.raises(search.TooManyWords, match=f"{search.MAX_WORDS + 1} different words"):
        search.parse_terms(f'"{many}"')
    terms = " ".join(f"w{k}" for k in range(search.MAX_TERMS + 1))
    with pytest.raises(search.TooManyWords, match="Quote words that belong together"):
        search.parse_terms(terms)
    assert len(search.parse_terms(f'"{terms}"').wanted) == 1  # one phrase: one term


def test_sqlite_statements_are_interrupted_at_the_bound(tmp_path, migrated_sqlite):
    url = migrated_sqlite(tmp_path / "t.db")
    endless = text("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
                   "SELECT count(*) FROM (SELECT x FROM c LIMIT 1000000000)")

    async def go():
        engine = search_engine(url, SearchBounds(seconds=0.3, connections=1))
        try:
            started = time.monotonic()
            with pytest.raises(Exception, match="interrupted"):
                async with engine.connect() as conn:
                    await conn.execute(endless)
            assert time.monotonic() - started < 2.0
            async with engine.connect() as conn:  # checked out again: a fresh deadline
                assert (await conn.execute(text("SELECT 1"))).scalar() == 1
        finally:
            await engine.dispose()

    asyncio.run(go())


@asynccontextmanager
async def _viewer(url: str, bounds: SearchBounds):
    engine = None
    from tracetap.storage.engine import create_engine
    engine = create_engine(url)
    await queries.create_episode(engine, episode_id="alpha", key_hash="alpha", group_id=None,
                                 task_id="t", harness_name="h", harness_config=None,
                                 metadata=None)
    await insert_calls(engine, conversation("alpha", "FileNotFoundError: conftest.py"))
    await engine.dispose()
    app = build_viewer(ViewerConfig(database_url=url, search=bounds),
                       Access(lambda _request: TOKEN), readers(), mounted=False)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}{PREFIX}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def _locked(url: str):
    """call_text locked by another connection; its own connection to watch Postgres."""
    dsn = url.replace("postgresql+asyncpg://", "postgresql://")
    locker, watcher = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    tx = locker.transaction()
    await tx.start()
    await locker.execute("LOCK TABLE call_text IN ACCESS EXCLUSIVE MODE")
    try:
        yield watcher
    finally:
        await tx.rollback()
        await locker.close()
        await watcher.close()


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, str, float]:
    started = time.monotonic()
    async with session.get(url) as reply:
        return reply.status, await reply.text(), time.monotonic() - started


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"})


async def _until(watcher, count: int, within: float) -> float:
    started = time.monotonic()
    while await watcher.fetchval(WAITING) != count:
        assert time.monotonic() - started < within, f"never {count} searches in Postgres"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


def test_postgres_stops_a_search_at_the_time_bound(migrated_postgres):
    async def go():
        async with _viewer(migrated_postgres, SearchBounds(seconds=0.5)) as base, \
                _session() as session:
            status, body, _ = await _get(session, base + "/search?q=zebracorn")
            assert status == 200 and "alpha" in body
            async with _locked(migrated_postgres) as watcher:
                status, body, took = await _get(session, base + "/search?q=zebracorn")
                assert status == 422 and "took longer than 0.5 s and was stopped" in body
                assert took < 2.0
                await _until(watcher, 0, within=1.0)  # nothing left running in Postgres
            for _ in range(3):  # the pool's connections came back usable
                status, body, _ = await _get(session, base + "/search?q=conftest")
                assert status == 200 and "alpha" in body
            status, body, _ = await _get(session, base + "/search?q=" + "+".join(
                f"w{k}" for k in range(63)))
            assert status == 400 and "63 different words" in body

    asyncio.run(go())


def test_postgres_cancels_a_search_whose_client_left(migrated_postgres):
    async def go():
        bounds = SearchBounds(seconds=30)  # the statement timeout is not what stops it
        async with _viewer(migrated_postgres, bounds) as base, _locked(migrated_postgres) \
                as watcher:
            async with _session() as session:
                request = asyncio.ensure_future(_get(session, base + "/search?q=zebracorn"))
                await _until(watcher, 1, within=5.0)  # the search waits in Postgres
                request.cancel()  # the person closes the tab
                with pytest.raises(asyncio.CancelledError):
                    await request
            assert await _until(watcher, 0, within=2.0) < 2.0  # cancelled there too

    asyncio.run(go())


def test_a_full_search_pool_refuses_and_the_other_pages_still_answer(migrated_postgres):
    async def go():
        bounds = SearchBounds(seconds=30, connections=1, wait=0.2)
        async with _viewer(migrated_postgres, bounds) as base, _session() as session:
            async with _locked(migrated_postgres) as watcher:
                first = asyncio.ensure_future(_get(session, base + "/search?q=zebracorn"))
                await _until(watcher, 1, within=5.0)
                status, body, took = await _get(session, base + "/search?q=conftest")
                assert status == 503 and "Try again in a moment" in body and took < 2.0
                status, body, _ = await _get(session, base + "/")
                assert status == 200 and "alpha" in body  # the reader's pool is apart
            status, body, _ = await first  # the lock gone, the first search answers
            assert status == 200 and "alpha" in body

    asyncio.run(go())
