"""storage.blocks: what is cut, named and packed always comes back byte for byte, and the
cuts fall where resent content recurs (a conversation's prefix, its earlier messages)."""

from __future__ import annotations

import json
import struct

from hypothesis import given
from hypothesis import strategies as st

from tracetap.storage.blocks import (
    BLOCK_TOKENS,
    FIRST_BLOCK_TOKENS,
    FLOATS,
    IDS,
    TEXT,
    codec,
    cut_ids,
    cut_text,
    join_text,
    pack_block,
    pack_refs,
    refs_length,
    segments,
    unpack_block,
    unpack_refs,
    whole,
)

_text = st.text(st.characters(codec="utf-8"), max_size=60)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": _text},
    optional={"name": _text, "tool_calls": st.lists(st.dictionaries(_text, _text), max_size=2)})
# How clients write JSON: compact, the standard library's default, pretty, ASCII or not.
_style = st.sampled_from([{"separators": (",", ":")}, {}, {"indent": 2}, {"indent": "\t"},
                          {"ensure_ascii": False}, {"separators": (" , ", " : ")}])


def _request(messages: list, style: dict, key: str = "messages", first: bool = False) -> str:
    body = {key: messages, "model": "m", "stream": True} if first else {
        "model": "m", "temperature": 0.5, key: messages, "tools": [{"type": "function"}]}
    return json.dumps(body, **style)


@given(st.text())
def test_any_text_joins_back_exactly(text):
    assert "".join(segments(text, "messages")) == text
    assert join_text(data for _, data in cut_text(text, "messages")[0]) == text


@given(st.lists(_message, max_size=6), _style, st.sampled_from(["messages", "input"]),
       st.booleans())
def test_a_request_is_cut_at_its_messages_and_joins_back(messages, style, key, first):
    text = _request(messages, style, key, first)
    pieces = segments(text, key)
    assert "".join(pieces) == text
    if messages:
        assert len(pieces) == len(messages) + 2  # before, each message, after
        for piece, message in zip(pieces[1:], messages):
            assert json.loads(piece.strip().lstrip(",").strip()) == message


@given(st.lists(_message, min_size=1, max_size=5), _message, _style)
def test_an_appended_message_leaves_the_earlier_pieces_as_they_were(messages, new, style):
    before = cut_text(_request(messages, style), "messages")[0]
    after = cut_text(_request([*messages, new], style), "messages")[0]
    # The head and every earlier message name the same blocks: stored once, referenced twice.
    assert [ref for ref, _ in after[:len(messages) + 1]] == \
        [ref for ref, _ in before[:len(messages) + 1]]


@given(st.lists(_message, max_size=4), st.lists(_message, max_size=3), _style,
       st.sampled_from(["", "x", ' "edited"']))
def test_a_body_resumed_from_the_last_calls_prefix_cuts_as_a_full_scan(
        messages, added, style, edit):
    first = _request(messages, style)
    _, prefix = cut_text(first, "messages")
    second = _request([*messages, *added], style)
    if edit:  # a history rewritten in place: the prefix no longer recurs
        second = second.replace("m", "m" + edit, 1)
    full, full_prefix = cut_text(second, "messages")
    resumed, resumed_prefix = cut_text(second, "messages", previous=prefix)
    assert [ref for ref, _ in resumed] == [ref for ref, _ in full]
    assert resumed_prefix == full_prefix
    assert "".join(p for p in segments(second, "messages")) == second


@given(st.text(alphabet='{}[],:"\\ abn', max_size=80))
def test_broken_json_still_joins_back(text):
    assert "".join(segments('{"messages": [' + text, "messages")) == '{"messages": [' + text


def _ids(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


_tokens = st.lists(st.integers(-(2 ** 31), 2 ** 31 - 1), max_size=3 * BLOCK_TOKENS)


@given(_tokens, _tokens, _tokens)
def test_a_prompt_extending_its_parent_reuses_every_parent_block(first, added, other):
    parent = cut_ids(_ids(first), None)
    assert b"".join(data for _, data in parent) == _ids(first)
    assert all(n <= FIRST_BLOCK_TOKENS for (_, n), _ in parent)
    parent_refs = [ref for ref, _ in parent]
    child = cut_ids(_ids(first + added), parent_refs)
    assert b"".join(data for _, data in child) == _ids(first + added)
    assert [ref for ref, _ in child][:len(parent_refs)] == parent_refs
    assert all(n <= BLOCK_TOKENS for (_, n), _ in child)
    # Any other prompt, whatever it shares with the parent, still joins back exactly.
    unrelated = cut_ids(_ids(other), parent_refs)
    assert b"".join(data for _, data in unrelated) == _ids(other)
    assert refs_length(pack_refs(ref for ref, _ in unrelated)) == len(other)


def test_the_samples_of_a_group_share_their_first_prompt_blocks():
    system = list(range(1000, 1000 + 3 * FIRST_BLOCK_TOKENS))
    a = cut_ids(_ids([*system, 1, 2, 3]), None)
    b = cut_ids(_ids([*system, 4, 5]), None)
    assert [ref for ref, _ in a][:3] == [ref for ref, _ in b][:3]


@given(st.binary(max_size=5000), st.sampled_from([IDS, FLOATS, TEXT]))
def test_any_block_unpacks_to_its_bytes(data, kind):
    assert unpack_block(pack_block(data, kind)) == data


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=600))
def test_logprobs_come_back_bit_for_bit(values):
    data = struct.pack(f"<{len(values)}d", *values)
    assert unpack_block(pack_block(data, FLOATS)) == data


def test_a_nan_with_a_payload_comes_back_bit_for_bit():
    data = struct.pack("<Q", 0x7FF8_0000_0000_0001) * 40 + struct.pack("<d", -1.5) * 40
    assert unpack_block(pack_block(data, FLOATS)) == data


def test_a_decimal_block_written_by_the_repr_form_reads_back():
    """Blocks stored before the decimal form came from msgspec were written with repr,
    which spells infinities and NaN ("inf", "nan") and exponents its own way ("1e-05",
    "1e+22"): they still read back to the same floats."""
    values = [-1e-05, 1e22, -0.0, float("inf"), float("-inf"), -0.6931471805599453] * 20
    text = ",".join(map(repr, values)).encode()
    payload = codec().compress(text, asbytes=True)
    stored = bytes((4,)) + len(text).to_bytes(4, "little") + payload  # _ZSTD_DECIMAL
    assert unpack_block(stored) == struct.pack(f"<{len(values)}d", *values)


def test_logprobs_are_stored_in_their_decimal_form():
    """A streamed turn's logprobs (a few digits each) take their shortest decimal form,
    whichever is smaller, and never lose a bit."""
    values = [-round(0.001 * (i % 997) + 0.01, 4) for i in range(400)]
    data = struct.pack("<400d", *values)
    stored = pack_block(data, FLOATS)
    assert stored[0] == 4  # _ZSTD_DECIMAL
    assert unpack_block(stored) == data


def test_token_ids_shrink_below_their_int32_size():
    import random
    rnd = random.Random(0)
    data = _ids([rnd.randrange(1000, 151_000) for _ in range(BLOCK_TOKENS)])
    assert len(pack_block(data, IDS)) < 0.7 * len(data)


@given(st.lists(st.tuples(st.binary(min_size=16, max_size=16), st.integers(0, 2 ** 32 - 1)),
                max_size=20))
def test_references_round_trip(refs):
    assert unpack_refs(pack_refs(refs)) == refs
    assert refs_length(pack_refs(refs)) == sum(n for _, n in refs)


def test_a_whole_block_counts_its_values():
    assert whole(FLOATS, b"\0" * 80)[0][1] == 10
    assert whole(IDS, b"\0" * 80)[0][1] == 20
    assert whole(TEXT, b"abc")[0][1] == 3
    assert whole(IDS, b"x")[0][0] != whole(TEXT, b"x")[0][0]  # the kind is part of the name


@given(_tokens, _tokens)
def test_ids_compared_with_the_parents_bytes_cut_as_when_hashed(first, added):
    parent = [ref for ref, _ in cut_ids(_ids(first), None)]
    hashed = cut_ids(_ids(first + added), parent)
    compared = cut_ids(_ids(first + added), parent, _ids(first))
    assert compared == hashed
    assert cut_ids(_ids(added), parent, _ids(first)) == cut_ids(_ids(added), parent)
