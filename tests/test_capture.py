"""End to end: the real openai SDK → tracetap → the mock vLLM engine, and what is stored."""

from __future__ import annotations

import asyncio

import openai
import pytest
from helpers.http import get, post

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
VOLATILE = ("id", "created")


def _clean(obj) -> dict:
    data = obj.model_dump()
    for key in VOLATILE:
        data.pop(key, None)
    return data


def _create(client, endpoint: str, stream: bool, logprobs: bool):
    if endpoint == "chat":
        extra = {"logprobs": True, "top_logprobs": 2} if logprobs else {}
        result = client.chat.completions.create(
            model="mock-model", messages=MESSAGES, max_tokens=12, stream=stream, **extra)
    else:
        extra = {"logprobs": 2} if logprobs else {}
        result = client.completions.create(
            model="mock-model", prompt="Once upon a time", max_tokens=12, stream=stream, **extra)
    if stream:
        return [_clean(chunk) for chunk in result]
    return _clean(result)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("logprobs", [False, True])
def test_client_sees_exactly_what_the_upstream_returns(proxy, engine, endpoint, stream, logprobs):
    direct = openai.OpenAI(base_url=engine.url, api_key="x")
    proxied = openai.OpenAI(base_url=proxy.episode_url("transparency"), api_key="x")
    with direct, proxied:
        assert _create(proxied, endpoint, stream, logprobs) == _create(direct, endpoint, stream,
                                                                   logprobs)


def _raw_upstream(engine, endpoint: str, stream: bool):
    """The engine's own answer with everything capture asks for, to compare against."""
    client = openai.OpenAI(base_url=engine.url, api_key="x")
    with client:
        if endpoint == "chat":
            kwargs = dict(model="mock-model", messages=MESSAGES, max_tokens=12, logprobs=True,
                          top_logprobs=0, extra_body={"return_token_ids": True})
            resp = client.chat.completions.create(**kwargs)
            choice = resp.choices[0]
            return (resp.model_extra["prompt_token_ids"], choice.model_extra["token_ids"],
                    [e.logprob for e in choice.logprobs.content])
        resp = client.completions.create(model="mock-model", prompt="Once upon a time",
                                         max_tokens=12, logprobs=0,
                                         extra_body={"return_token_ids": True})
        choice = resp.choices[0]
        return (choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"],
                choice.logprobs.token_logprobs)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_stored_tokens_and_logprobs_equal_the_upstreams(proxy, engine, endpoint, stream):
    episode = f"exact-{endpoint}-{stream}"
    client = openai.OpenAI(base_url=proxy.episode_url(episode), api_key="x")
    with client:
        _create(client, endpoint, stream, logprobs=False)
    prompt_ids, completion_ids, logprobs = _raw_upstream(engine, endpoint, stream)
    [call] = proxy.calls(episode)
    [choice] = call["choices"]
    assert call["prompt_ids"] == prompt_ids
    assert choice["completion_ids"] == completion_ids
    assert choice["completion_logprobs"] == logprobs  # float64: exact, not approximately
    assert choice["token_source"] == "engine"
    assert call["status"] == "ok" and call["http_status"] == 200
    assert call["stream"] is stream
    assert call["model"] == "mock-model"
    assert call["prompt_tokens"] == len(prompt_ids)
    assert call["completion_tokens"] == len(completion_ids)
    assert call["t_start"] <= call["t_first_byte"] <= call["t_end"]
    assert call["upstream_latency"] > 0


def test_streamed_call_is_stored_reassembled(proxy):
    client = openai.OpenAI(base_url=proxy.episode_url("reassembly"), api_key="x")
    with client:
        chunks = list(client.chat.completions.create(
            model="mock-model", messages=MESSAGES, max_tokens=20, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    [call] = proxy.calls("reassembly")
    import json

    response = json.loads(call["response"])
    assert response["object"] == "chat.completion"
    assert response["choices"][0]["message"]["content"] == text
    assert response["choices"][0]["finish_reason"] == chunks[-1].choices[0].finish_reason
    assert call["choices"][0]["text"] == text


def test_tool_call_deltas_are_merged(proxy):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"step": {"type": "integer"}}}}}]
    client = openai.OpenAI(base_url=proxy.episode_url("tools"), api_key="x")
    with client:
        direct = client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                                tools=tools)
        chunks = list(client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                                     tools=tools, stream=True))
    assert direct.choices[0].finish_reason == "tool_calls"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    import json

    _, streamed = proxy.calls("tools")
    message = json.loads(streamed["response"])["choices"][0]["message"]
    expected = direct.choices[0].message.tool_calls[0]
    [call] = message["tool_calls"]
    assert call["function"]["name"] == expected.function.name == "lookup"
    assert json.loads(call["function"]["arguments"]) == json.loads(expected.function.arguments)


def test_n_greater_than_one_stores_one_choice_per_index(proxy):
    client = openai.OpenAI(base_url=proxy.episode_url("n2"), api_key="x")
    with client:
        resp = client.chat.completions.create(model="mock-model", messages=MESSAGES, n=3,
                                              max_tokens=8)
        list(client.chat.completions.create(model="mock-model", messages=MESSAGES, n=3,
                                            max_tokens=8, stream=True))
    calls = proxy.calls("n2")
    assert [c["stream"] for c in calls] == [False, True]  # both stored, in arrival order
    for call in calls:
        assert [c["index"] for c in call["choices"]] == [0, 1, 2]
        for stored, returned in zip(call["choices"], resp.choices):
            assert stored["text"] == returned.message.content
            assert len(stored["completion_ids"]) == len(stored["completion_logprobs"]) > 0


def test_async_client_with_fifty_concurrent_streams_over_ten_episodes(proxy):
    async def agent(episode: str, turn: int, client: openai.AsyncOpenAI):
        stream = await client.chat.completions.create(
            model="mock-model", max_tokens=6, stream=True,
            messages=[{"role": "user", "content": f"turn {turn} of {episode}"}],
            extra_headers={"X-Tracetap-Episode": episode})
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run():
        client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x")
        async with client:
            jobs = [agent(f"conc-{i % 10}", i // 10, client) for i in range(50)]
            return await asyncio.gather(*jobs)

    texts = asyncio.run(run())
    assert all(texts)
    total = 0
    for e in range(10):
        calls = proxy.calls(f"conc-{e}")
        total += len(calls)
        assert sorted(c["seq"] for c in calls) == list(range(5))
        assert all(c["status"] == "ok" and c["choices"][0]["completion_ids"] for c in calls)
    assert total == 50


def test_untagged_calls_are_recorded(proxy):
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x")
    with client:
        client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=4)
    calls = proxy.calls(None)
    assert len(calls) == 1 and calls[0]["episode_id"] is None


def test_exposed_paths_are_relayed_untouched_and_others_refused(proxy, engine):
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x")
    with client:
        models = client.models.list()
    assert [m.id for m in models.data] == ["mock-model"]
    status, tokens = post(proxy.url + "/tokenize", b'{"prompt": "hi"}')
    assert status == 200 and "tokens" in tokens
    status, refused = get(proxy.url + "/version")
    assert status == 404
    assert refused["error"]["code"] == "not_exposed"
    assert proxy.calls(None) == []
