"""storage.journal_record: prompt ids journaled as the packed bytes the proxy built, and
journals written before that (the ids as a msgpack list) still replay."""

from __future__ import annotations

import asyncio

import msgspec

from tracetap.proxy.episodes.ids import uuid7
from tracetap.storage import journal_record, queries
from tracetap.storage.codec import pack_ids
from tracetap.storage.engine import create_engine
from tracetap.storage.journal import Journal
from tracetap.storage.records import CallRecord, ChoiceRecord, has_prompt_ids, prompt_ids_of
from tracetap.storage.writer import Writer

_OLD = msgspec.msgpack.Encoder().encode  # the journal's format before packed ids


def _record(i: int, ids: list[int], packed: bool) -> CallRecord:
    # as the proxy makes them: the ids packed (no list) or, before, a list
    return CallRecord(call_id=uuid7(), episode_id="j", seq=i, endpoint="chat.completions",
                      t_start=float(i), request='{"messages":[]}',
                      prompt_ids=None if packed else ids,
                      prompt_ids_packed=pack_ids(ids) if packed else None,
                      choices=[ChoiceRecord(index=0, completion_ids=[7, 8],
                                            completion_logprobs=[-0.5, -0.25])])


def test_packed_ids_are_journaled_without_the_list_and_read_back_as_one():
    ids = [1, 2**31 - 1, -5, 150_000]
    record = _record(0, ids, packed=True)
    for given in (record, msgspec.structs.replace(record, prompt_ids=ids)):  # both: one copy
        payload = journal_record.encode(given)
        back = journal_record.decode(payload)
        assert back.prompt_ids is None and back.prompt_ids_packed == pack_ids(ids)
        assert prompt_ids_of(back) == ids and has_prompt_ids(back)
    # without packed bytes the record is journaled exactly as before
    plain = _record(1, ids, packed=False)
    assert journal_record.encode(plain) == _OLD(plain)
    assert journal_record.decode(_OLD(plain)) == plain


def test_a_journal_written_before_packed_ids_replays_beside_a_new_one(db_url, tmp_path):
    # records 0-1 as the previous release journaled them, 2-3 as this one does, in one
    # conversation (so the writer's dedup reuses blocks across the two shapes)
    prompts = [list(range(1, 40 * (i + 1))) for i in range(4)]
    records = [_record(i, prompts[i], packed=i >= 2) for i in range(4)]
    journal = Journal(tmp_path / "j", max_bytes=1 << 20)
    for record in records[:2]:
        journal.append(_OLD(record))
    for record in records[2:]:
        journal.append(journal_record.encode(record))
    journal.close()  # the process stops here: nothing was written

    async def restart():
        engine = create_engine(db_url)
        writer = Writer(engine, Journal(tmp_path / "j", max_bytes=1 << 20))
        await writer.flush()
        calls = await queries.calls_of(engine, "j")
        await engine.dispose()
        return calls, writer.journal.bytes

    calls, left = asyncio.run(restart())
    assert left == 0
    assert [c["prompt_ids"] for c in calls] == prompts
    assert [c["choices"][0]["completion_ids"] for c in calls] == [[7, 8]] * 4


def _long(request: str, ids: list[int], **fields) -> CallRecord:
    return msgspec.structs.replace(_record(5, ids, packed=True), request=request, **fields)


def test_pieces_join_to_the_records_encoding():
    """The request and the packed ids written apart (journal_record.pieces) make the
    same bytes as one encode, on either side of the size they are written apart from."""
    texts = ["x" * 65535, "x" * 65536, '{"m":"' + "é" * 70000 + '"}', "{}"]
    prompts = [list(range(16383)), list(range(16384)), [1, 2]]
    for text in texts:
        for ids in prompts:
            record = _long(text, ids, response="r" * 3000)
            parts = journal_record.pieces(record)
            assert b"".join(parts) == journal_record.encode(record)
            assert journal_record.decode(b"".join(parts)) == msgspec.structs.replace(
                record, prompt_ids=None)
    assert len(journal_record.pieces(_long("x" * 65536, list(range(16384))))) == 7  # both apart


def test_a_record_that_holds_a_stand_in_is_encoded_whole():
    record = _long("x" * 70000, [1, 2], response=journal_record._REQUEST)
    assert journal_record.pieces(record) == [journal_record.encode(record)]


def test_a_lone_surrogate_raises_as_the_encoder_does():
    record = _long("\ud800" * 70000, [1, 2])
    for encode in (journal_record.encode, journal_record.pieces):
        try:
            encode(record)
        except (ValueError, TypeError) as exc:
            assert "surrogate" in str(exc) or isinstance(exc, UnicodeEncodeError)
        else:
            raise AssertionError("encoded a lone surrogate")


def test_pieces_are_journaled_as_one_record(tmp_path):
    record = _long("y" * 80000, list(range(20000)))
    journal = Journal(tmp_path / "j", max_bytes=1 << 22)
    assert journal.append(journal_record.pieces(record))
    assert journal.append(journal_record.encode(record))
    segment = journal.seal()
    from tracetap.storage.journal import read_segment
    first, second = read_segment(segment)
    assert first == second == journal_record.encode(record)


def test_the_clients_bytes_are_written_in_place_of_the_request():
    """The client's body handed in with the record (its request decoded from it, no byte
    replaced) is written as it is: the same bytes as encoding the text."""
    from tracetap.proxy.call.record import client_text, request_utf8
    body = ('{"messages":[{"role":"user","content":"' + "héllo " * 20000 + '"}]}').encode()
    record = _long(client_text(body), list(range(20000)))
    utf8 = request_utf8(record, body)
    assert utf8 is body
    parts = journal_record.pieces(record, utf8)
    assert any(part is body for part in parts)
    assert b"".join(parts) == journal_record.encode(record)


def test_a_body_that_is_not_utf8_is_not_written_in_place():
    from tracetap.proxy.call.record import client_text, request_utf8
    body = b'{"messages":"' + b"\xff" * 70000 + b'"}'
    record = _long(client_text(body), [1, 2])
    assert request_utf8(record, body) is None
    assert b"".join(journal_record.pieces(record)) == journal_record.encode(record)
