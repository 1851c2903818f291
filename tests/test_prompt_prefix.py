"""proxy.prompt_prefix: an episode's next prompt ids decoded in their new tokens only,
and always equal to a whole decode."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetap.proxy.tokens.prompt_prefix import PromptPrefixes
from tracetap.storage.codec import pack_ids


def _raw(ids: list[int], spaced: bool = False) -> bytes:
    return json.dumps(ids, separators=(", ", ": ") if spaced else (",", ":")).encode()


def test_a_growing_prompt_is_decoded_in_its_new_tokens_and_shares_the_old_ones():
    prefixes = PromptPrefixes()
    first = prefixes.decode("e", _raw([5, 6, 7]))
    second = prefixes.decode("e", _raw([5, 6, 7, 80, 9]))
    assert (first, second) == ([5, 6, 7], [5, 6, 7, 80, 9])
    assert prefixes.extended == 1
    # no list of the prompt is made: its packed bytes are extended
    assert prefixes.decode_packed("e", _raw([5, 6, 7, 80, 9, 10**6])) == (
        None, pack_ids([5, 6, 7, 80, 9, 10**6]))
    assert prefixes.extended == 2


@pytest.mark.parametrize("before, after", [
    ([5, 6, 7], [5, 6, 70, 8]),  # a digit added to the last old id: not an extension
    ([5, 6, 7], [5, 6]),  # shorter
    ([5, 6, 7], [9, 6, 7, 8]),  # an edited history
    ([], [1, 2]),  # nothing to share
])
def test_anything_but_an_extension_is_decoded_whole(before, after):
    prefixes = PromptPrefixes()
    prefixes.decode("e", _raw(before))
    assert prefixes.decode("e", _raw(after)) == after
    assert prefixes.extended == 0


def test_other_spacing_other_episodes_and_no_episode_decode_whole():
    prefixes = PromptPrefixes()
    prefixes.decode("e", _raw([1, 2]))
    assert prefixes.decode("e", _raw([1, 2, 3], spaced=True)) == [1, 2, 3]
    assert prefixes.decode("f", _raw([1, 2, 3, 4])) == [1, 2, 3, 4]
    assert prefixes.decode(None, _raw([1, 2, 3, 4, 5])) == [1, 2, 3, 4, 5]
    assert prefixes.extended == 0


def test_bad_new_ids_raise_and_the_same_prompt_again_is_a_copy():
    prefixes = PromptPrefixes()
    ids = prefixes.decode("e", b"[1,2]")
    with pytest.raises(msgspec.ValidationError):
        prefixes.decode("e", b'[1,2,"x"]')
    again = prefixes.decode("e", b"[1,2]")
    assert again == ids and again is not ids


def test_the_oldest_episodes_go_first_past_the_byte_cap():
    prefixes = PromptPrefixes(max_bytes=30)  # one 3-token entry holds 7 + 12 bytes
    prefixes.decode("a", _raw([1, 2, 3]))
    assert prefixes.held_bytes == 19
    prefixes.decode("b", _raw([4, 5, 6]))  # two would pass the cap: "a" goes
    assert prefixes.held_bytes == 19
    assert prefixes.decode("a", _raw([1, 2, 3, 4])) == [1, 2, 3, 4]
    assert prefixes.extended == 0


def test_an_entry_larger_than_the_cap_is_not_kept():
    prefixes = PromptPrefixes(max_bytes=18)
    prefixes.decode("a", _raw([1, 2, 3]))
    assert prefixes.held_bytes == 0
    assert prefixes.decode("a", _raw([1, 2, 3, 4])) == [1, 2, 3, 4]
    assert prefixes.extended == 0


def test_a_finished_episode_is_forgotten():
    prefixes = PromptPrefixes()
    prefixes.decode("a", _raw([1, 2, 3]))
    prefixes.decode("b", _raw([1, 2, 3]))
    prefixes.forget("a")
    prefixes.forget("nobody")  # never seen: nothing happens
    assert prefixes.decode("a", _raw([1, 2, 3, 4])) == [1, 2, 3, 4]
    assert prefixes.extended == 0
    assert prefixes.decode("b", _raw([1, 2, 3, 4])) == [1, 2, 3, 4]
    assert prefixes.extended == 1


def test_the_packed_ids_are_storage_s_bytes_of_the_list_and_none_past_int32():
    prefixes = PromptPrefixes()
    for prompt in ([5, 6], [5, 6, 7, 2**31 - 1], [5, 6, 7, 2**31 - 1, 8]):
        assert prefixes.decode_packed("e", _raw(prompt)) == (None, pack_ids(prompt))
    assert prefixes.extended == 2
    ids, packed = prefixes.decode_packed("e", _raw([5, 6, 7, 2**31 - 1, 8, 2**31]))
    assert ids == [5, 6, 7, 2**31 - 1, 8, 2**31] and packed is None
    assert prefixes.extended == 3
    # the next extension of an unpackable prompt stays a list, its ids still exact
    assert prefixes.decode_packed("e", _raw([5, 6, 7, 2**31 - 1, 8, 2**31, 1])) == (
        [5, 6, 7, 2**31 - 1, 8, 2**31, 1], None)
    assert prefixes.extended == 4
    assert prefixes.decode_packed(None, _raw([1, -2])) == (None, pack_ids([1, -2]))


@settings(max_examples=200, deadline=None)
@given(turns=st.lists(st.lists(st.integers(0, 300_000), max_size=6), min_size=1, max_size=6),
       restart=st.integers(0, 6))
def test_any_sequence_of_prompts_decodes_as_a_whole_decode_would(turns, restart):
    prefixes = PromptPrefixes()
    prompt: list[int] = []
    for i, new in enumerate(turns):
        prompt = (new if i == restart else prompt + new)
        ids, packed = prefixes.decode_packed("e", _raw(prompt))
        assert (ids, packed) == (None, pack_ids(prompt)) or (ids == prompt and packed is None)
        assert prefixes.decode(None, _raw(prompt)) == prompt
