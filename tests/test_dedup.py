"""Each token stored once (storage.dedup, storage.inflate), on SQLite and Postgres: calls
read back exactly as captured, a conversation's prefix and a group's shared first prompt
are stored once, a writer that forgot finds the last call in the database, and a refused
batch leaves nothing referenced that was not stored."""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3

import pytest
from asyncpg.exceptions import IntegrityConstraintViolationError
from sqlalchemy import event, text
from sqlalchemy.engine import Engine

from tracetap.exporters import export
from tracetap.proxy.apis.registry import readers
from tracetap.storage import queries
from tracetap.storage.blocks import unpack_refs
from tracetap.storage.dedup import BlockCache
from tracetap.storage.engine import create_engine
from tracetap.storage.footprint import stored_ids
from tracetap.storage.records import CallRecord, ChoiceRecord
from tracetap.storage.rows import insert_calls

READERS = readers()  # each API's request shape, as the proxy composes them

SYSTEM, TOOL, OUT = 700, 300, 60  # tokens: a shared system prompt, each tool result, each reply


def conversation(episode: str, turns: int, seed: int, *, n: int = 1) -> list[CallRecord]:
    """An agent's calls: each resends the whole conversation (the request text pretty
    printed, non-ASCII, the way some clients send it) and the engine's prompt ids."""
    rnd = random.Random(seed)
    system = list(range(5000, 5000 + SYSTEM))  # the same in every conversation
    ids, messages, records = list(system), [{"role": "system", "content": "Be brief. é"}], []
    for turn in range(turns):
        tool = [rnd.randrange(100_000) for _ in range(TOOL)]
        ids += tool
        messages.append({"role": "user", "content": f"result {turn}: " + "ü " * rnd.randrange(9)})
        outs = [[rnd.randrange(100_000) for _ in range(OUT)] for _ in range(n)]
        logprobs = [[-rnd.random() * 5 for _ in range(OUT)] for _ in range(n)]
        reply = [f"answer {turn}.{i} ✓" for i in range(n)]
        records.append(CallRecord(
            call_id=f"{episode}-{turn:03d}", episode_id=episode, seq=turn,
            endpoint="chat.completions", model="m", t_start=1000.0 + turn, t_end=1000.5 + turn,
            http_status=200, prompt_ids=list(ids),
            request=json.dumps({"model": "m", "messages": messages, "logprobs": True},
                               indent=1, ensure_ascii=False),
            response=json.dumps({"choices": [{"index": i, "message": {"content": r}}
                                             for i, r in enumerate(reply)]}),
            upstream_request=None if turn % 2 else json.dumps({"messages": messages}),
            choices=[ChoiceRecord(index=i, finish_reason="stop", text=reply[i],
                                  completion_ids=outs[i], completion_logprobs=logprobs[i],
                                  token_source="engine") for i in range(n)]))
        ids += outs[0]
        messages.append({"role": "assistant", "content": reply[0]})
    return records


def _run(url: str, step):
    async def run():
        engine = create_engine(url)
        try:
            return await step(engine)
        finally:
            await engine.dispose()

    return asyncio.run(run())


def _same(stored: dict, record: CallRecord) -> None:
    for field in ("request", "response", "upstream_request", "prompt_ids", "prompt_tokens"):
        assert stored[field] == getattr(record, field), field
    assert [(c["index"], c["text"], c["completion_ids"], c["completion_logprobs"])
            for c in stored["choices"]] == [
        (c.index, c.text, c.completion_ids, c.completion_logprobs) for c in record.choices]


async def _prompt_blocks(engine) -> dict[bytes, int]:
    """Distinct prompt blocks referenced, with their lengths in ids."""
    async with engine.connect() as conn:
        rows = (await conn.execute(text("SELECT prompt_refs FROM calls"))).all()
    blocks = {h: n for (refs,) in rows if refs is not None for h, n in unpack_refs(refs)}
    held = await stored_ids(engine)  # what benchmarks report: the same count
    assert held.prompt == sum(blocks.values())
    return blocks


def test_calls_read_back_exactly_and_each_prompt_token_is_stored_once(db_url):
    turns = 6
    group = [conversation(f"sample-{k}", turns, seed=k, n=1 + k) for k in range(3)]

    async def step(engine):
        cache = BlockCache()
        for turn in range(turns):  # a turn of every sample per batch, as the writer does
            await insert_calls(engine, [calls[turn] for calls in group], cache, readers=READERS)
        stored = {k: await queries.calls_of(engine, f"sample-{k}") for k in range(3)}
        return stored, await _prompt_blocks(engine)

    stored, blocks = _run(db_url, step)
    held = _run(db_url, stored_ids)
    assert held.completion == sum(len(c.completion_ids) for calls in group for r in calls
                                  for c in r.choices)
    for k, calls in enumerate(group):
        assert len(stored[k]) == turns
        for got, record in zip(stored[k], calls):
            _same(got, record)
    # The samples share the system prompt's blocks, each conversation's prefix is stored
    # once: no prompt id is stored twice but the tail of each first prompt's last block.
    unique = SYSTEM + 3 * turns * TOOL + 3 * (turns - 1) * OUT
    assert unique <= sum(blocks.values()) <= 1.1 * unique
    firsts = [unpack_refs(_refs(db_url, f"sample-{k}-000")) for k in range(3)]
    assert firsts[0][:2] == firsts[1][:2] == firsts[2][:2]


def _refs(url: str, call_id: str) -> bytes:
    async def step(engine):
        async with engine.connect() as conn:
            return (await conn.execute(text("SELECT prompt_refs FROM calls WHERE call_id = :c"),
                                       {"c": call_id})).scalar()

    return _run(url, step)


def test_a_writer_that_forgot_finds_the_last_call_in_the_database(db_url):
    calls = conversation("long", 6, seed=1)

    async def step(engine):
        await insert_calls(engine, calls[:3], BlockCache(), readers=READERS)
        # A restart: nothing cached.
        await insert_calls(engine, calls[3:], BlockCache(), readers=READERS)
        return await queries.calls_of(engine, "long"), await _prompt_blocks(engine)

    stored, blocks = _run(db_url, step)
    for got, record in zip(stored, calls, strict=True):
        _same(got, record)
    assert sum(blocks.values()) == len(calls[-1].prompt_ids)  # nothing stored twice
    before = unpack_refs(_refs(db_url, "long-002"))
    assert unpack_refs(_refs(db_url, "long-003"))[:len(before)] == before


def test_a_refused_batch_leaves_nothing_referenced_that_was_not_stored(db_url):
    calls = conversation("refused", 4, seed=2)
    cache = BlockCache()

    async def step(engine):
        await insert_calls(engine, calls[:1], cache, readers=READERS)
        poisoned = calls[1]
        poisoned.seq = None  # NOT NULL: the database refuses the batch
        with pytest.raises((sqlite3.IntegrityError, IntegrityConstraintViolationError)):
            await insert_calls(engine, [poisoned], cache, readers=READERS)
        poisoned.seq = 1
        # The next call extends the refused one: its blocks must be written now.
        await insert_calls(engine, calls[2:], cache, readers=READERS)
        return await queries.calls_of(engine, "refused")

    stored = _run(db_url, step)
    assert [c["call_id"] for c in stored] == ["refused-000", "refused-002", "refused-003"]
    for got, record in zip(stored, [calls[0], *calls[2:]]):
        _same(got, record)


def test_calls_without_an_episode_or_a_body_are_stored_as_they_came(db_url):
    bare = CallRecord(call_id="bare", endpoint="completions", t_start=5.0, http_status=502,
                      status="upstream_error", request="", response=None, prompt_ids=[],
                      choices=[ChoiceRecord(index=0, text="", completion_ids=[],
                                            completion_logprobs=[])])

    async def step(engine):
        await insert_calls(engine, [bare], readers=READERS)
        return await queries.calls_of(engine, None)

    [stored] = _run(db_url, step)
    _same(stored, bare)
    assert stored["request"] == "" and stored["prompt_ids"] == [] and stored["response"] is None


def test_a_call_without_ids_in_the_middle_does_not_make_the_next_store_its_prompt_again(
        db_url):
    calls = conversation("gap", 4, seed=9)
    failed = CallRecord(call_id="gap-002-failed", episode_id="gap", seq=99,
                        endpoint="chat.completions", t_start=1002.2, http_status=500,
                        status="upstream_error", request=calls[2].request)
    cache = BlockCache()

    async def step(engine):
        for batch in ([calls[0]], [calls[1]], [failed], [calls[2]], [calls[3]]):
            await insert_calls(engine, batch, cache, readers=READERS)
        return await queries.calls_of(engine, "gap"), await _prompt_blocks(engine)

    stored, blocks = _run(db_url, step)
    assert len(stored) == 5
    assert sum(blocks.values()) == len(calls[-1].prompt_ids)  # nothing stored twice


def test_the_export_reads_each_block_once_not_each_calls_whole_prompt(db_url, tmp_path):
    group = [conversation(f"read-{k}", 8, seed=20 + k) for k in range(2)]
    asked: list[int] = []

    def count(conn, cursor, statement, parameters, context, executemany):
        if "FROM blocks" in statement:
            asked.append(len(parameters))  # one bound hash per block asked for

    async def step(engine):
        for calls in group:
            await insert_calls(engine, calls, readers=READERS)
            await queries.finish_episode(engine, calls[0].episode_id, reward=1.0,
                                         rewards=None, outcome=None, info=None)
        async with engine.connect() as conn:  # every block the export writes out
            refs = [r for row in (await conn.execute(text(
                "SELECT prompt_refs, request_refs, upstream_request_refs, response_refs "
                "FROM calls UNION ALL SELECT completion_ids_refs, completion_logprobs_refs, "
                "NULL, NULL FROM choices"))).all() for r in row if r is not None]
        named = [h for r in refs for h, _ in unpack_refs(r)]
        return len(set(named)), len(named)

    stored, referenced = _run(db_url, step)
    event.listen(Engine, "after_cursor_execute", count)
    try:
        export(db_url, tmp_path / "out")
    finally:
        event.remove(Engine, "after_cursor_execute", count)
    assert sum(asked) == stored  # every block once (one page): the unique tokens
    assert referenced > 3 * stored  # what reading every call's whole prompt would take
