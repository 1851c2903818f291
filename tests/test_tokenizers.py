"""proxy/tokens/engine_tokenizer.py on its own: which family an engine is, and exactly what each
family's tokenize endpoints are asked and how their answers are read.

The engines are played in-process (helpers.tokenize_engine); test_token_ids.py runs the
same families through the proxy against the mock engine."""

from __future__ import annotations

import asyncio

import pytest
from helpers.tokenize_engine import BOS, TokenizeEngine, ids_of, render

from tracetap.proxy.tokens import engine_tokenizer as tokenizers
from tracetap.proxy.tokens.engine_tokenizer import (
    LlamaCppPython,
    LlamaServer,
    NoChatTemplate,
    TokenizeFailed,
    Vllm,
    detect,
)

BASE = "http://engine:8000/v1"
ORIGIN = "http://engine:8000"
MESSAGES = [{"role": "user", "content": "hi"}]


def found(family: str, **kwargs):
    engine = TokenizeEngine(family, **kwargs)
    tokenizer, reached = asyncio.run(detect(engine, BASE))
    return engine, tokenizer, reached


@pytest.mark.parametrize(("family", "kind", "probes", "interrupts"), [
    ("llama-server", LlamaServer, ["/apply-template"], False),
    ("vllm", Vllm, ["/apply-template", "/tokenize"], False),
    ("llama-cpp-python", LlamaCppPython, ["/apply-template", "/tokenize", "/extras/tokenize"],
     True),
])
def test_each_family_is_found_by_its_probe_in_order_at_the_origin(family, kind, probes,
                                                                   interrupts):
    engine, tokenizer, reached = found(family)
    assert type(tokenizer) is kind and reached
    assert tokenizer.kind == family and tokenizer.interrupts_streams is interrupts
    assert tokenizer.origin == ORIGIN and tokenizer.client is engine
    assert [(origin, path) for origin, path, _ in engine.asked] == [(ORIGIN, p) for p in probes]
    assert engine.asked[0][2] == {"messages": [{"role": "user", "content": "hi"}]}
    assert all(body == {"prompt": "hi"} for _, path, body in engine.asked if path == "/tokenize")


def test_an_engine_without_endpoints_is_reached_and_a_down_one_is_not():
    assert found("none")[1:] == (None, True)
    engine, tokenizer, reached = found("down")
    assert (tokenizer, reached) == (None, False) and len(engine.asked) == 3


def test_an_answer_without_the_probes_key_is_not_that_family():
    class Odd(TokenizeEngine):  # answers 200 everywhere, never with the key asked for
        async def post_json(self, url, body, timeout=10.0):
            self.asked.append((url, body, timeout))
            return 200, {"other": 1}

    engine = Odd("none")
    assert asyncio.run(detect(engine, BASE)) == (None, True)
    assert [timeout for _, _, timeout in engine.asked] == [5.0] * 3  # probes are short


def test_llama_server_renders_without_generation_keys_then_tokenizes_with_specials():
    engine, tokenizer, _ = found("llama-server")
    request = {"model": "m", "messages": MESSAGES, "stream": True, "max_tokens": 5, "n": 2,
               "logprobs": True, "top_logprobs": 2, "stream_options": {}, "tools": [],
               "return_token_ids": True, "max_completion_tokens": 5}
    ids = asyncio.run(tokenizer.chat_prompt(request))
    assert ids == ids_of(render(MESSAGES), bos=True)
    template, tokenize = engine.asked[-2:]
    assert template[1:] == ("/apply-template", {"model": "m", "messages": MESSAGES, "tools": []})
    assert tokenize[1:] == ("/tokenize", {"content": render(MESSAGES), "add_special": True,
                                          "parse_special": True})


def test_llama_server_pieces_come_with_their_bytes():
    engine, tokenizer, _ = found("llama-server", pieces={ord("b") + 10: [0xE2, 0x96, 0],
                                                         ord("c") + 10: [256],
                                                         ord("d") + 10: 7})
    pieces = asyncio.run(tokenizer.pieces("abcd"))
    assert pieces == [(ord("a") + 10, b"a"), (ord("b") + 10, b"\xe2\x96\x00"),
                      (ord("c") + 10, None), (ord("d") + 10, None)]
    assert engine.asked[-1][1:] == ("/tokenize", {"content": "abcd", "add_special": False,
                                                  "parse_special": True, "with_pieces": True})


@pytest.mark.parametrize("answer", [{"tokens": [1, 2]}, {"tokens": "x"}, {}])
def test_llama_server_pieces_that_are_not_pieces_fail(answer):
    engine, tokenizer, _ = found("llama-server")

    async def post_json(url, body, timeout=10.0):
        return 200, answer

    engine.post_json = post_json
    with pytest.raises(TokenizeFailed) as failed:
        asyncio.run(tokenizer.pieces("ab"))
    assert str(failed.value) == "POST /tokenize gave no pieces"


def test_llama_server_without_a_rendered_prompt_fails():
    engine, tokenizer, _ = found("llama-server")

    async def post_json(url, body, timeout=10.0):
        return 200, {"prompt": None}

    engine.post_json = post_json
    with pytest.raises(TokenizeFailed) as failed:
        asyncio.run(tokenizer.chat_prompt({"messages": MESSAGES}))
    assert str(failed.value) == "POST /apply-template gave no prompt"


def test_vllm_is_sent_only_what_changes_its_render():
    engine, tokenizer, _ = found("vllm")
    request = {"model": "m", "messages": MESSAGES, "tools": [], "add_generation_prompt": False,
               "continue_final_message": True, "add_special_tokens": False,
               "chat_template": "t", "chat_template_kwargs": {"k": 1}, "documents": [],
               "mm_processor_kwargs": {}, "stream": True, "max_tokens": 3, "temperature": 0}
    asyncio.run(tokenizer.chat_prompt(request))
    sent = engine.asked[-1][2]
    assert sent == {k: v for k, v in request.items()
                    if k not in ("stream", "max_tokens", "temperature")}


def test_vllm_prompts_get_specials_text_does_not_and_pieces_are_detokenized_once():
    engine, tokenizer, _ = found("vllm")
    assert asyncio.run(tokenizer.prompt("ab")) == [BOS, *ids_of("ab")]
    assert engine.asked[-1][1:] == ("/tokenize", {"prompt": "ab", "add_special_tokens": True})
    before = len(engine.asked)

    async def twice():
        return await tokenizer.pieces("aba"), await tokenizer.pieces("ab")

    first, second = asyncio.run(twice())
    assert first == [(ord("a") + 10, b"a"), (ord("b") + 10, b"b"), (ord("a") + 10, b"a")]
    assert second == first[:2]
    asked = engine.asked[before:]
    assert asked[0][1:] == ("/tokenize", {"prompt": "aba", "add_special_tokens": False})
    detokenized = sorted(body["tokens"] for _, path, body in asked if path == "/detokenize")
    assert detokenized == [[ord("a") + 10], [ord("b") + 10]]  # each id asked once


def test_a_piece_the_engine_cannot_give_is_unknown_not_an_error():
    _, tokenizer, _ = found("vllm", fail=("/detokenize",))
    assert asyncio.run(tokenizer.pieces("a")) == [(ord("a") + 10, None)]
    for family in ("vllm", "llama-cpp-python"):  # an answer without the piece's text
        _, tokenizer, _ = found(family, pieces={ord("a") + 10: 5})
        assert asyncio.run(tokenizer.pieces("a")) == [(ord("a") + 10, None)], family


def test_the_piece_cache_is_bounded_and_starting_over_loses_no_piece(monkeypatch):
    """Found by mutation testing: the cache used to start over after this text's known
    pieces were counted as known, and they came back unknown (a right completion
    "unverified")."""
    monkeypatch.setattr(tokenizers, "PIECE_CACHE", 3)
    _, tokenizer, _ = found("vllm")

    async def run():
        await tokenizer.pieces("ab")
        kept = dict(tokenizer._pieces)
        await tokenizer.pieces("cd")  # 2 + 2 > 3: the cache starts over
        return kept, dict(tokenizer._pieces), await tokenizer.pieces("abc")

    kept, after, last = asyncio.run(run())
    assert set(kept) == {ord("a") + 10, ord("b") + 10}
    assert set(after) == {ord("c") + 10, ord("d") + 10}
    assert last == [(ord(c) + 10, c.encode()) for c in "abc"]  # "c" was known, then cleared
    assert set(tokenizer._pieces) == {ord(c) + 10 for c in "abc"}


def test_llama_cpp_python_strips_its_bos_and_has_no_template():
    engine, tokenizer, _ = found("llama-cpp-python")
    with pytest.raises(NoChatTemplate):
        asyncio.run(tokenizer.chat_prompt({"messages": MESSAGES}))
    assert asyncio.run(tokenizer.prompt("ab")) == [BOS, *ids_of("ab")]

    async def run():
        return await tokenizer.text_ids("ab"), await tokenizer.text_ids("c")

    assert asyncio.run(run()) == (ids_of("ab"), ids_of("c"))
    inputs = [body["input"] for _, path, body in engine.asked if path == "/extras/tokenize"]
    assert inputs == ["hi", "ab", "", "ab", "c"]  # the BOS learnt once, from ""
    assert asyncio.run(tokenizer.pieces("a")) == [(ord("a") + 10, b"a")]
    assert engine.asked[-1][1:] == ("/extras/detokenize", {"tokens": [ord("a") + 10]})


def test_llama_cpp_python_text_without_its_bos_fails():
    engine, tokenizer, _ = found("llama-cpp-python")
    answers = iter([[BOS], [7, 8]])

    async def post_json(url, body, timeout=10.0):
        return 200, {"tokens": next(answers)}

    engine.post_json = post_json
    with pytest.raises(TokenizeFailed) as failed:
        asyncio.run(tokenizer.text_ids("x"))
    assert str(failed.value) == "POST /extras/tokenize did not start with its BOS"


@pytest.mark.parametrize(("status", "data", "message"), [
    (500, {"error": "x"}, "POST /tokenize answered 500"),
    (0, None, "POST /tokenize answered nothing"),
    (200, None, "POST /tokenize answered 200"),
])
def test_an_endpoint_that_fails_says_which_and_how(status, data, message):
    engine, tokenizer, _ = found("vllm")

    async def post_json(url, body, timeout=10.0):
        return status, data

    engine.post_json = post_json
    with pytest.raises(TokenizeFailed) as failed:
        asyncio.run(tokenizer.prompt("a"))
    assert str(failed.value) == message


@pytest.mark.parametrize(("tokens", "message"), [
    (None, "no token list in the answer"), ("1 2", "no token list in the answer"),
    ({"0": 1}, "no token list in the answer"), ([1, "2"], "not a token id: '2'"),
    ([1, 2.0], "not a token id: 2.0"), ([True], "not a token id: True")])
def test_token_ids_must_be_a_list_of_integers(tokens, message):
    engine, tokenizer, _ = found("vllm")

    async def post_json(url, body, timeout=10.0):
        return 200, {"tokens": tokens}

    engine.post_json = post_json
    with pytest.raises(TokenizeFailed) as failed:
        asyncio.run(tokenizer.prompt("a"))
    assert str(failed.value) == message


def test_the_base_class_renders_nothing_and_leaves_the_rest_to_a_family():
    base = tokenizers.EngineTokenizer(TokenizeEngine("none"), ORIGIN)
    assert (base.kind, base.interrupts_streams) == ("", False)
    with pytest.raises(NoChatTemplate):
        asyncio.run(base.chat_prompt({}))
    for call in (base.prompt("a"), base.text_ids("a"), base.piece(1)):
        with pytest.raises(NotImplementedError):
            asyncio.run(call)
