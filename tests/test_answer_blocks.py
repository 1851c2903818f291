"""A choice's completion resent in the next prompt is one block (storage.blocks.cut_ids,
storage.dedup): found where the last prompt ends, it is the block the choice stored;
anywhere else, or not whole, the prompt is cut as before. Either way every prompt joins
back to its ids exactly."""

from __future__ import annotations

import asyncio
import random

from sqlalchemy import text

from tracetap.proxy.apis.registry import readers
from tracetap.storage import queries
from tracetap.storage.blocks import ANSWER_SLACK, IDS, cut_ids, unpack_refs, whole
from tracetap.storage.codec import pack_ids, unpack_ids
from tracetap.storage.dedup import BlockCache
from tracetap.storage.engine import create_engine
from tracetap.storage.footprint import stored_ids
from tracetap.storage.records import CallRecord, ChoiceRecord
from tracetap.storage.rows import insert_calls

READERS = readers()
RND = random.Random(7)
FIRST = [RND.randrange(100_000) for _ in range(700)]
ANSWER = [RND.randrange(100_000) for _ in range(300)]
TOOL = [RND.randrange(100_000) for _ in range(500)]
LATER = [RND.randrange(100_000) for _ in range(200)]


def _cut(ids: list[int], parent_ids: list[int], answers: list[list[int]]):
    parent = cut_ids(pack_ids(parent_ids), None)
    pieces = cut_ids(pack_ids(ids), [ref for ref, _ in parent], pack_ids(parent_ids),
                     tuple(pack_ids(a) for a in answers))
    assert b"".join(data for _, data in pieces) == pack_ids(ids)  # exact, always
    return [ref for ref, _ in pieces]


ANSWER_REF = whole(IDS, pack_ids(ANSWER))[0]


def test_an_answer_where_the_prompt_ended_is_the_choices_block():
    assert ANSWER_REF in _cut(FIRST + ANSWER + TOOL, FIRST, [ANSWER])
    template = [1, 2, 3]  # a chat template's tokens before the answer
    assert ANSWER_REF in _cut(FIRST + template + ANSWER + TOOL, FIRST, [ANSWER])
    # The second of two choices, continued instead of the first.
    assert ANSWER_REF in _cut(FIRST + ANSWER + TOOL, FIRST, [TOOL[:40], ANSWER])


def test_anything_else_is_cut_as_before():
    changed = [ANSWER[0] + 1, *ANSWER[1:]]  # re-tokenized: not the answer whole
    far = [9] * (ANSWER_SLACK + 1)
    for ids in (FIRST + changed + TOOL, FIRST + far + ANSWER + TOOL, FIRST + TOOL):
        refs = _cut(ids, FIRST, [ANSWER])
        assert ANSWER_REF not in refs
        assert refs == _cut(ids, FIRST, [])  # the cut without answers
    short = ANSWER[:10]  # too short to be worth a block
    assert whole(IDS, pack_ids(short))[0] not in _cut(FIRST + short + TOOL, FIRST, [short])


def test_an_answer_found_between_ids_is_not_taken():
    packed = pack_ids(ANSWER)
    shifted = unpack_ids(b"\x00\x00" + packed + b"\x00\x00")  # two bytes into an id
    assert pack_ids(shifted).find(packed) == 2
    assert ANSWER_REF not in _cut(FIRST + shifted + TOOL, FIRST, [ANSWER])


def _record(call_id: str, turn: int, prompt: list[int], answer: list[int]) -> CallRecord:
    return CallRecord(
        call_id=call_id, episode_id="ep", seq=turn, endpoint="chat.completions", model="m",
        t_start=1000.0 + turn, t_end=1000.5 + turn, http_status=200, prompt_ids=prompt,
        request='{"model": "m", "messages": [{"role": "user", "content": "go"}]}',
        response='{"choices": []}',
        choices=[ChoiceRecord(index=0, finish_reason="stop", text="ok", completion_ids=answer,
                              completion_logprobs=[-0.5] * len(answer),
                              token_source="engine")])


def test_the_answer_is_stored_once_and_every_call_reads_back(db_url):
    second = FIRST + ANSWER + TOOL
    retokenized = [*second, 5, *LATER[1:], *TOOL]  # the second answer, not as sampled
    calls = [_record("c0", 0, FIRST, ANSWER), _record("c1", 1, second, LATER),
             _record("c2", 2, retokenized, [4, 5, 6])]

    async def step(engine):
        cache = BlockCache()
        for call in calls:
            await insert_calls(engine, [call], cache, readers=READERS)
        async with engine.connect() as conn:
            refs = dict((await conn.execute(text(
                "SELECT call_id, prompt_refs FROM calls"))).all())
            answer = (await conn.execute(text(
                "SELECT completion_ids_refs FROM choices WHERE call_id = 'c0'"))).scalar()
            copies = (await conn.execute(text("SELECT count(*) FROM blocks WHERE hash = :h"),
                                         {"h": ANSWER_REF[0]})).scalar()
        return (await queries.calls_of(engine, "ep"), refs, answer, copies,
                await stored_ids(engine))

    async def run():
        engine = create_engine(db_url)
        try:
            return await step(engine)
        finally:
            await engine.dispose()
    stored, refs, answer, copies, held = asyncio.run(run())
    assert unpack_refs(answer) == [ANSWER_REF] and copies == 1
    assert ANSWER_REF in unpack_refs(refs["c1"])
    assert ANSWER_REF not in unpack_refs(refs["c2"])[len(unpack_refs(refs["c1"])):]
    for got, call in zip(stored, calls, strict=True):
        assert got["prompt_ids"] == call.prompt_ids
        assert got["choices"][0]["completion_ids"] == call.choices[0].completion_ids
    # Each id once: the answer counts once though a prompt and a choice name it.
    assert held.shared == len(ANSWER)
    assert held.total == len(retokenized) + len(LATER) + 3
