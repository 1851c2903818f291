"""An engine's /tokenize answer for an agent's prompt, read in its new ids only.

vLLM's /tokenize answers a chat's prompt ids whole; the resolver keeps each episode's last
answer (proxy.tokens.prompt_prefix) and decodes only what follows it when the new answer
extends it byte for byte, else the whole answer: the ids are the same either way.
"""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from helpers.tokenize_engine import TokenizeEngine, ids_of, render

from tracetap.proxy.tokens import engine_tokenizer
from tracetap.proxy.tokens.prompt_prefix import PromptPrefixes
from tracetap.proxy.tokens.resolve import TokenResolver
from tracetap.storage.records import CallRecord, ChoiceRecord, prompt_ids_of

UPSTREAM = "http://engine:8000/v1"


def call(messages: list[dict], episode: str | None = "ep", *, count: bool = True,
         **request) -> CallRecord:
    prompt = ids_of(render(messages), bos=True)
    return CallRecord(call_id=f"c{len(messages)}", episode_id=episode,
                      endpoint="chat.completions", t_start=0.0, http_status=200,
                      upstream=UPSTREAM,
                      request=json.dumps({"model": "m", "messages": messages, **request}),
                      prompt_tokens=len(prompt) if count else None,
                      choices=[ChoiceRecord(index=0, text="ok", token_strs=["o", "k"])])


def turns(n: int) -> list[list[dict]]:
    """An agent's conversation after each of ``n`` turns: each extends the last."""
    messages, out = [{"role": "system", "content": "be brief"}], []
    for turn in range(n):
        messages = [*messages, {"role": "user", "content": f"step {turn}"}]
        out.append(messages)
        messages = [*messages, {"role": "assistant", "content": "ok"}]
    return out


def run(records: list[CallRecord], engine: TokenizeEngine, prefixes: PromptPrefixes,
        ) -> list[str]:
    counted: list[str] = []
    resolver = TokenResolver(engine, counted.append, prefixes=prefixes)
    for record in records:  # one at a time, as an agent's calls are written
        assert asyncio.run(resolver([record])) == []
    return counted


def test_an_agents_prompts_are_decoded_in_their_new_ids_and_are_the_whole_prompts():
    prefixes = PromptPrefixes()
    conversation = turns(4)
    records = [call(messages) for messages in conversation]
    assert run(records, TokenizeEngine("vllm"), prefixes) == []
    assert prefixes.extended == 3  # every call after the first
    for record, messages in zip(records, conversation):
        assert prompt_ids_of(record) == ids_of(render(messages), bos=True)
        assert record.prompt_source == "engine_tokenize" and record.ids_missing is None
        # packed as storage keeps them: no list of the whole prompt was made
        assert record.prompt_ids is None and record.prompt_ids_packed is not None


def test_a_prompt_that_does_not_extend_the_last_is_decoded_whole():
    prefixes = PromptPrefixes()
    first, second = turns(2)
    edited = [{"role": "system", "content": "be long"}, *second[1:]]  # history rewritten
    other = call(second, episode="other")  # another episode: nothing of its own yet
    records = [call(first), call(edited), other, call(second)]
    assert run(records, TokenizeEngine("vllm"), prefixes) == []
    assert prefixes.extended == 0
    for record, messages in zip(records, [first, edited, second, second]):
        assert prompt_ids_of(record) == ids_of(render(messages), bos=True)


def test_calls_without_an_episode_are_decoded_whole():
    prefixes = PromptPrefixes()
    records = [call(messages, episode=None) for messages in turns(3)]
    assert run(records, TokenizeEngine("vllm"), prefixes) == []
    assert prefixes.extended == 0
    assert [prompt_ids_of(r) for r in records] == [ids_of(render(m), bos=True)
                                                   for m in turns(3)]


def test_only_the_members_that_change_the_render_are_sent_as_the_client_wrote_them():
    engine = TokenizeEngine("vllm")
    record = call(turns(1)[0], count=False, tools=[{"type": "function"}], max_tokens=9,
                  logprobs=True, stream=True, chat_template_kwargs={"enable_thinking": 1.0})
    record.request = record.request.replace('"content": "be brief"', '"content": "be\\u0020brief"')
    sent = []

    async def post_raw(url, body, timeout=10.0):
        sent.append(body)
        return await TokenizeEngine.post_raw(engine, url, body, timeout)

    engine.post_raw = post_raw
    assert run([record], engine, PromptPrefixes()) == []
    prompt = [body for body in sent if b'"messages"' in body]
    # each member's bytes as the client spelled them (json.dumps's spaces, its escape)
    assert prompt == [b'{"model":"m","messages":[{"role": "system", "content": "be\\u0020brief"}, '
                      b'{"role": "user", "content": "step 0"}],"tools":[{"type": "function"}],'
                      b'"chat_template_kwargs":{"enable_thinking": 1.0}}']
    assert engine_tokenizer._VllmChatRender.__struct_fields__ == engine_tokenizer._VLLM_CHAT_KEYS


@pytest.mark.parametrize(("answer", "reason"), [
    ({"tokens": [1, True]}, "tokenize_failed"), ({"tokens": [1, 2.0]}, "tokenize_failed"),
    ({"tokens": [1, "2"]}, "tokenize_failed"), ({"tokens": "1 2"}, "tokenize_failed"),
    ({"tokens": None}, "tokenize_failed"), ({"count": 2}, "tokenize_failed"),
    ([1, 2], "tokenize_failed"), ({"tokens": [1, 2]}, "count_mismatch")])
def test_an_answer_that_is_not_the_prompts_ids_is_not_kept(answer, reason):
    engine = TokenizeEngine("vllm")
    first, second = turns(2)
    assert run([call(first)], engine, prefixes := PromptPrefixes()) == []

    async def post_json(url, body, timeout=10.0):
        if "messages" in body:
            return 200, answer
        return await TokenizeEngine.post_json(engine, url, body, timeout)

    engine.post_json = post_json
    record = call(second)
    assert run([record], engine, prefixes) == [reason]
    assert prompt_ids_of(record) is None and record.ids_missing == reason
    assert record.choices[0].completion_ids == ids_of("ok")  # the completion still is


def test_an_answer_extending_the_last_with_a_bad_id_is_not_kept():
    """The memcmp matches the old ids; the new ones are still checked."""
    engine = TokenizeEngine("vllm")
    first, second = turns(2)
    assert run([call(first)], engine, prefixes := PromptPrefixes()) == []
    ids = ids_of(render(first), bos=True)

    async def post_raw(url, body, timeout=10.0):
        if b'"messages"' in body:
            return 200, msgspec.json.encode({"tokens": ids})[:-2] + b",7,true]}"
        return await TokenizeEngine.post_raw(engine, url, body, timeout)

    engine.post_raw = post_raw
    record = call(second, count=False)
    assert run([record], engine, prefixes) == ["tokenize_failed"]
    assert prompt_ids_of(record) is None


def test_a_request_that_is_not_an_object_is_unsupported():
    record = call(turns(1)[0])
    record.request = "[1, 2]"
    assert run([record], TokenizeEngine("vllm"), PromptPrefixes()) == ["unsupported_request"]


@pytest.mark.parametrize(("answer", "array"), [
    (b'{"count":2,"max_model_len":9,"tokens":[1,2],"token_strs":null}', b"[1,2]"),  # cut
    (b'{"tokens": [1, 2] }', b"[1, 2]"),
    (b'{"a":{"tokens":[9]},"tokens":[1,2]}', b"[1,2]"),  # a nested one is not the member
    (b'{"tokens":[1,2],"tokens":[3]}', b"[3]"),  # the last, as a decoder reads it
    (b'{"tokens":[[1],2]}', b"[[1],2]"),  # not plain: read whole (and refused when decoded)
])
def test_the_answers_token_array_is_the_member_a_json_decoder_reads(answer, array):
    assert engine_tokenizer._tokens_array(answer) == array


@pytest.mark.parametrize("answer", [b'{"tokens":[1,2]', b'{"tokens":[1,2]} x',
                                    b'[{"tokens":[1]}]', b'{"tokens":[1],"count":}'])
def test_an_answer_that_is_not_a_json_object_fails(answer):
    with pytest.raises(engine_tokenizer.TokenizeFailed):
        engine_tokenizer._tokens_array(answer)
