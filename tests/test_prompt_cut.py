"""proxy.prompt_cut: the first chunk's prompt ids cut out by bytes, or left for a full decode.

Whatever the chunk, a cut must leave exactly the chunk without its top-level
``prompt_token_ids`` member and give back exactly that member's array; when the member
is not in the plain shape the answer is None (the caller then decodes the whole chunk).
"""

from __future__ import annotations

import json

import openai
import pytest
from aiohttp import web
from helpers.chat_upstreams import scripted_chat_app, stream_chunks
from helpers.loop import free_port
from helpers.servers import Proxy
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetap.proxy.apis.chat import CHAT
from tracetap.proxy.apis.chat.capture import Capture
from tracetap.proxy.apis.chat.prompt_cut import cut_prompt_ids
from tracetap.proxy.runtime.settings import Settings

IDS = list(range(100, 140))
CHOICES = [{"index": 0, "delta": {"role": "assistant", "content": "Hé"}, "logprobs": None,
            "finish_reason": None, "token_ids": [5]}]


def _check(data: bytes, ids: list[int]) -> None:
    cut = cut_prompt_ids(data)
    assert cut is not None
    rest, array = cut
    whole = json.loads(data)
    del whole["prompt_token_ids"]
    assert json.loads(rest) == whole
    assert json.loads(array) == ids


@pytest.mark.parametrize("text", [
    # vLLM's compact shape, the member last
    json.dumps({"id": "c", "choices": CHOICES, "prompt_token_ids": IDS}, separators=(",", ":")),
    # Python's json spacing, non-ASCII as is
    json.dumps({"id": "c", "choices": CHOICES, "prompt_token_ids": IDS}, ensure_ascii=False),
    # the member first, then in the middle
    json.dumps({"prompt_token_ids": IDS, "id": "c", "choices": CHOICES}),
    json.dumps({"id": "c", "prompt_token_ids": IDS, "choices": CHOICES}),
    # the only member, and odd whitespace around every token
    '{ "prompt_token_ids" :\n [ 1 ,2,\t3 ] }',
    '{"a": 1 ,\r\n  "prompt_token_ids"\t:[ ]  , "b" : [2]}',
    # strings holding brackets, braces and escaped quotes before the member
    json.dumps({"x": "[{\"]}\\", "y": ["]", {"z": "}"}], "prompt_token_ids": IDS}),
])
def test_a_top_level_array_of_ids_is_cut_out_exactly(text):
    data = text.encode()
    _check(data, json.loads(data)["prompt_token_ids"])


@pytest.mark.parametrize("text", [
    '{"id": "c", "choices": []}',  # absent
    '{"id": "c", "prompt_token_ids": null}',  # not an array
    '{"id": "c", "prompt_\\u0074oken_ids": [1, 2]}',  # escaped key: the full decode reads it
    '{"choices": [{"index": 0, "prompt_token_ids": [1, 2]}]}',  # nested (completions)
    '{"a": {"prompt_token_ids": [1, 2]}, "b": 1}',  # nested, in an object
    '{"prompt_token_ids": [[1], [2]]}',  # arrays inside: its first ] is not its end
    '{"prompt_token_ids": [1, "2]"]}',  # a string inside
    '{"prompt_token_ids": [1, {"a": 2}]}',  # an object inside
    '{"content": "\\"prompt_token_ids\\": [1]"}',  # inside a string
    '{"prompt_token_ids": [1, 2',  # cut short
])
def test_anything_but_the_plain_shape_is_left_for_the_full_decode(text):
    assert cut_prompt_ids(text.encode()) is None


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6),
                     st.text(alphabet='ab"\\[]{},: é\n', max_size=8))
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.sampled_from(["a", "prompt_token_ids", "b\"", "c"]), inner, max_size=3)),
    max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(members=st.dictionaries(st.sampled_from(["id", "choices", "usage", "x[", "y{"]), _values,
                               max_size=4),
       ids=st.lists(st.integers(0, 200_000), max_size=30), position=st.integers(0, 4),
       spaced=st.booleans(), ascii_only=st.booleans())
def test_any_chunk_either_cuts_exactly_or_is_left_whole(members, ids, position, spaced,
                                                        ascii_only):
    items = list(members.items())
    items.insert(min(position, len(items)), ("prompt_token_ids", ids))
    separators = (", ", ": ") if spaced else (",", ":")
    data = json.dumps(dict(items), separators=separators, ensure_ascii=ascii_only).encode()
    # The generated shape is always the plain one: it must be cut, and exactly.
    _check(data, ids)


@settings(max_examples=200, deadline=None)
@given(value=_values)
def test_a_cut_never_changes_what_a_chunk_means(value):
    """Any JSON at all: either None, or the exact member and the rest."""
    data = json.dumps(value).encode()
    cut = cut_prompt_ids(data)
    if cut is None:
        return
    assert isinstance(value, dict) and isinstance(value.get("prompt_token_ids"), list)
    _check(data, value["prompt_token_ids"])


def test_capture_decodes_cut_ids_when_read_and_notes_bad_ones():
    capture = Capture(CHAT)
    rest, array = cut_prompt_ids(json.dumps(
        {"id": "c", "model": "m", "choices": CHOICES, "prompt_token_ids": IDS}).encode())
    capture.add_prompt_ids(array)
    capture.add(rest)
    assert capture.prompt_ids == IDS and not capture.errors
    assert capture.prompt_ids == IDS and not capture.errors  # decoded once: read again
    capture = Capture(CHAT)
    capture.add_prompt_ids(b"[1, 2, x]")
    assert capture.prompt_ids is None
    assert capture.errors and "prompt_token_ids" in capture.errors[0]


@pytest.mark.parametrize("asks", [{}, {"extra_body": {"return_token_ids": True}}],
                         ids=["stripped", "asked"])
def test_a_long_prompts_ids_are_cut_from_the_first_chunk_and_stored_exactly(proxy, engine,
                                                                           asks):
    """Through the proxy: vLLM's first chunk carries a long prompt's ids (over the 4 KiB
    the relay cuts above); the stored ids are the engine's, twice in one episode (the
    second prompt grown from the first), and the client gets them only when it asked."""
    long = "the quick brown fox jumps over the lazy dog " * 40  # ~1800 ids, ~7 KiB
    direct = openai.OpenAI(base_url=engine.url, api_key="x", max_retries=0)
    client = openai.OpenAI(base_url=proxy.episode_url("long"), api_key="x", max_retries=0)
    with direct, client:
        for turn in (long, long + "and again"):
            messages = [{"role": "user", "content": turn}]
            want = direct.chat.completions.create(
                model="mock-model", messages=messages, max_tokens=4,
                extra_body={"return_token_ids": True}).model_extra["prompt_token_ids"]
            assert len(json.dumps(want)) > 4096
            chunks = list(client.chat.completions.create(
                model="mock-model", messages=messages, max_tokens=4, stream=True, **asks))
            got = [c.model_extra.get("prompt_token_ids") for c in chunks]
            assert got[0] == (want if asks else None) and not any(got[1:])
            assert proxy.calls("long")[-1]["prompt_ids"] == want


def test_the_first_chunk_reaches_the_client_before_its_prompt_ids_are_decoded(
        proxy, monkeypatch):
    """The order itself (the first token is not held by the prompt's ids): the
    relay cuts a long prompt's ids out of vLLM's first chunk as bytes, the client's
    write of that chunk goes out, and only then are the ids decoded (when the record is
    made). Observed in the proxy's process: the cut, the proxy's writes to its client
    (not the engine's, in this process too) and the decode, in the order they happen.
    Kills every way of skipping the cut: the chunk decoded whole, ids and all, before
    the client gets a byte of it."""
    order: list[str] = []
    add_prompt_ids, decode_prompt = Capture.add_prompt_ids, Capture._decode_prompt

    def spied_add_prompt_ids(self, raw, *args):
        order.append("cut")
        return add_prompt_ids(self, raw, *args)

    def spied_decode_prompt(self):
        if self._prompt_raw is not None:
            order.append("decoded")
        return decode_prompt(self)

    write = web.StreamResponse.write

    async def spied_write(self, data):
        if self._req is not None and self._req.path.startswith("/episodes/"):
            order.append("written")
        return await write(self, data)

    monkeypatch.setattr(Capture, "add_prompt_ids", spied_add_prompt_ids)
    monkeypatch.setattr(Capture, "_decode_prompt", spied_decode_prompt)
    monkeypatch.setattr(web.StreamResponse, "write", spied_write)
    long = "the quick brown fox jumps over the lazy dog " * 40  # ~1800 ids, ~7 KiB
    client = openai.OpenAI(base_url=proxy.episode_url("order"), api_key="x", max_retries=0)
    with client:
        chunks = list(client.chat.completions.create(
            model="mock-model", messages=[{"role": "user", "content": long}], max_tokens=4,
            stream=True, extra_body={"mock_chunk_delay_s": 0.02}))  # a read per chunk
    assert chunks and not any(c.model_extra.get("prompt_token_ids") for c in chunks)
    assert order.count("cut") == 1 and order.count("decoded") == 1
    assert order.index("cut") < order.index("written") < order.index("decoded")
    assert len(proxy.calls("order")[0]["prompt_ids"]) > 1000


def test_a_long_first_chunk_whose_ids_are_not_in_the_plain_shape_is_read_whole(
        loop_thread, serve_app, migrated_sqlite, tmp_path):
    """A first chunk over the 4 KiB the relay cuts above, holding ``prompt_token_ids``
    in a shape the byte cut leaves alone (here inside the choice, not at the top): the
    relay reads the chunk whole, the client gets every word and the call is stored."""
    text = "word " * 1200  # ~6 KiB in the first content chunk
    chunks = stream_chunks(text, pieces=1)
    chunks[1]["choices"][0]["prompt_token_ids"] = IDS
    assert len(json.dumps(chunks[1])) > 4096 and cut_prompt_ids(
        json.dumps(chunks[1]).encode()) is None
    config = Settings(upstream=serve_app(scripted_chat_app(chunks)) + "/v1",
                      db=migrated_sqlite(tmp_path / "tracetap.db"),
                      data_dir=str(tmp_path / "d"), port=free_port())
    proxy = Proxy(loop_thread, config).start()
    try:
        client = openai.OpenAI(base_url=proxy.episode_url("nested"), api_key="x",
                               max_retries=0)
        with client:
            got = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
                if c.choices)
        [call] = proxy.calls("nested")
    finally:
        proxy.stop()
    assert got == text
    assert call["status"] == "ok" and call["choices"][0]["text"] == text
