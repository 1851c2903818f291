"""The viewer's full-text search (storage.search, migration 0011) on both databases: what
the writer indexes (a call's new turn, not its resent history), the query syntax, the
filters on model, policy, harness config factors and metadata, idempotent replays, prune,
and the backfill of calls stored before the migration."""

from __future__ import annotations

import asyncio
import functools
import json
import subprocess
import sys

import pytest
from helpers.search_calls import (
    T0,
    chat,
    conversation,
    index_nothing,
    matching,
)
from sqlalchemy import func, select

from tracetap.migrations import upgrade
from tracetap.proxy.apis.registry import readers
from tracetap.storage import queries, retention, search
from tracetap.storage.engine import create_engine
from tracetap.storage.records import CallRecord
from tracetap.storage.rows import insert_calls
from tracetap.storage.search_text import call_text
from tracetap.storage.tables import CallText
from tracetap.viewer.search import parse_where

READERS = readers()  # each API's request shape, as the proxy composes them

def test_a_call_indexes_its_new_turn_not_the_history_it_resends():
    first, second = conversation("e", "FileNotFoundError: conftest.py")
    text = call_text(first, READERS)
    assert "Zebracorn" in text and "fix the failing" in text
    text = call_text(second, READERS)
    assert "Zebracorn" not in text and "fix the failing" not in text  # resent: not again
    assert "FileNotFoundError" in text and "pytest -x" in text and "done" in text
    failed = chat("x", "e", [{"role": "user", "content": "hi"}], "", error="upstream 502")
    assert "upstream 502" in call_text(failed, READERS)
    messages = CallRecord(call_id="a", episode_id="e", endpoint="messages", t_start=T0,
                          status="ok", http_status=200, instance="i", request=json.dumps({
                              "system": "sys words", "messages": [
                                  {"role": "user", "content": [{"type": "tool_result",
                                   "tool_use_id": "u", "content": [
                                       {"type": "text", "text": "quokka output"}]}]}]}))
    text = call_text(messages, READERS)
    assert "quokka output" in text and "sys words" in text
    assert call_text(CallRecord(call_id="b", episode_id="e", endpoint="chat.completions",
                                t_start=T0, status="ok", http_status=200, instance="i",
                                request="not json"), READERS) == ""


def test_query_syntax():
    assert search.parse_terms('disk "no space" -warning') == search.Terms(
        ("disk", "no space"), ("warning",))
    assert search.parse_terms("  ** ") is None
    assert search.parse_terms("or").wanted == ("or",)


async def _seed(engine) -> None:
    for episode, harness_config, metadata in (
            ("alpha", {"context": "full", "retries": 3}, {"batch": "variants"}),
            ("beta", {"context": "summarised", "retries": 3, "strict": True}, None),
            ("gamma", None, {"batch": "other"})):
        await queries.create_episode(engine, episode_id=episode, key_hash=episode,
                                     group_id=None, task_id="t", harness_name="h",
                                     harness_config=harness_config, metadata=metadata)
    records = [*conversation("alpha", "FileNotFoundError: conftest.py", policy="v1"),
               *conversation("beta", "No space left on device", model="m2", policy="v2"),
               chat("gamma-0", "gamma", [{"role": "user", "content": "hello"}], "",
                    error="upstream timed out after 30 s")]
    await insert_calls(engine, records, readers=READERS)
    await insert_calls(engine, records, readers=READERS)  # a journal replayed: indexed once


def test_search_and_filters_on_both_databases(db_url):
    asyncio.run(_search_and_filters(db_url))


async def _search_and_filters(db_url: str) -> None:
    engine = create_engine(db_url)
    try:
        await _seed(engine)
        async with engine.connect() as conn:
            assert (await conn.execute(select(func.count()).select_from(CallText))).scalar() == 5
        ids = functools.partial(matching, engine)
        assert await ids("zebracorn") == ["alpha", "beta"]  # case-insensitive, whole word
        assert await ids("filenotfounderror") == ["alpha"]  # tool output
        assert await ids('"no space left"') == ["beta"]  # a phrase
        # A phrase is its words in one call: the index keeps no positions (0012).
        assert await ids('"space no"') == ["beta"]
        assert await ids('"no conftest"') == []  # in two calls of two episodes
        assert await ids("timed") == ["gamma"]  # an error
        assert await ids("zebracorn -device") == ["alpha"]  # in none of the episode's calls
        assert await ids("zebracorn conftest") == ["alpha"]  # each word in some call
        assert await ids("zebra") == []  # words are whole
        assert await ids(None, parse_where({"model": "m2"})) == ["beta"]
        assert await ids("zebracorn", parse_where({"policy": "v1"})) == ["alpha"]
        assert await ids(None, parse_where({"where": "config.context=summarised"})) == ["beta"]
        assert await ids(None, parse_where({"where": "config.retries=3"})) == ["alpha", "beta"]
        assert await ids(None, parse_where({"where": "config.strict=true"})) == ["beta"]
        assert await ids(None, parse_where({"where": "config.strict=null"})) == [
            "alpha", "gamma"]
        assert await ids(None, parse_where(
            {"where": "meta.batch=variants, config.retries=3"})) == ["alpha"]
        found = await search.snippets(engine, search.parse_terms("FileNotFoundError"),
                                      ["alpha", "beta"], READERS)
        assert list(found) == ["alpha"] and found["alpha"].call_id == "alpha-1"
        assert found["alpha"].match == "FileNotFoundError" and found["alpha"].matches == 1
        # prune's delete takes the calls' search rows with them
        async with engine.begin() as conn:
            await retention._delete(conn, ["beta"], ["beta-0", "beta-1"], READERS)
        assert await ids("zebracorn") == ["alpha"]
    finally:
        await engine.dispose()


def test_bad_where_terms_are_named():
    from tracetap.viewer.params import BadParameter
    for bad in ("context=full", "config.=x", "config.a b=1", "other.x=1", "config.x="):
        with pytest.raises(BadParameter, match=r"config\.NAME=VALUE"):
            parse_where({"where": bad})


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_the_migration_backfills_calls_stored_before_it(tmp_path, request, kind):
    url = f"sqlite:///{tmp_path / 'old.db'}" if kind == "sqlite" \
        else request.getfixturevalue("fresh_postgres")
    upgrade(url, "0010")  # the revision before 0011

    async def old_writer():  # the writer before 0011: no call_text table yet
        import tracetap.storage.rows as rows
        engine = create_engine(url)
        saved = rows.index_calls
        rows.index_calls = index_nothing
        try:
            await insert_calls(engine, conversation("old", "SegfaultGremlin at 0x0"),
                               readers=READERS)
            await insert_calls(engine, [chat("old-2", "old", [], "", error="x")], readers=READERS)
        finally:
            rows.index_calls = saved
            await engine.dispose()
    asyncio.run(old_writer())
    upgrade(url)

    async def found():
        engine = create_engine(url)
        try:
            return [await matching(engine, "segfaultgremlin"), await matching(engine, "zebracorn"),
                    await matching(engine, '"gremlin at"')]
        finally:
            await engine.dispose()
    assert asyncio.run(found()) == [["old"], ["old"], []]


def test_search_bench_stays_runnable(postgres):
    done = subprocess.run([sys.executable, "bench/search_bench.py", "--episodes", "300",
                           "--rounds", "1"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["episodes"] == 300 and len(figures["results"]) >= 15
    assert all(r["p50"] > 0 for r in figures["results"].values())
    assert "worst p95" in done.stdout and "load average" in done.stdout
