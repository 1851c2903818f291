"""What a continued stream promises (proxy.continuation), checked against what the
engine received: after a weight sync in abort mode cuts a chat stream, the continuation
sent to ``/v1/completions`` is the expected body field by field (the prompt ids plus the
partial ids, what is left of the token cap, the request's sampling fields, the logprobs
asked), the usage the client and storage see counts each id once, a request with tools
is never continued, and a bad-typed field the continuation would read is refused before
anything is sent. Real openai SDK, proxy and the recording mock engine."""

from __future__ import annotations

import openai
import pytest
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.demo.tokenizer import EOS
from tracetap.proxy.runtime.settings import Settings
from tracetap.storage import budget_ledger

CONTENT = "The quick brown fox jumps over the lazy dog, then rests by the river bank."
MESSAGES = [{"role": "user", "content": "tell me about the fox"}]
TOKENS = len(CONTENT) + 1  # one byte token each, then the end of the turn
# Every sampling field a continuation carries over, with values unlike the defaults.
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 5,
            "stop": ["zzz"], "stop_token_ids": [3], "presence_penalty": 0.1,
            "frequency_penalty": 0.2, "repetition_penalty": 1.05, "ignore_eos": False,
            "skip_special_tokens": True, "spaces_between_special_tokens": False,
            "logit_bias": {"300": -1}, "bad_words": ["zebra"], "allowed_token_ids": None,
            "include_stop_str_in_output": False}


@pytest.fixture
def proxy(loop_thread, recording_engine, tmp_path, migrated_sqlite):
    settings = Settings(upstream=recording_engine, upstream_flavor="vllm",
                        db=migrated_sqlite(tmp_path / "c.db"), data_dir=str(tmp_path / "d"),
                        port=free_port(), episode_max_tokens=1_000_000)  # a ledger row each
    proxy = Proxy(loop_thread, settings).start()
    assert proxy.admin("PUT", "/tracetap/policy", {"version": "v1"})[0] == 200
    yield proxy
    proxy.stop()


def _weight_sync(proxy) -> None:
    status, answer = proxy.admin("POST", "/tracetap/pause", {"mode": "abort", "timeout": 10})
    assert status == 200 and answer["drained"] is True
    assert proxy.admin("POST", "/tracetap/resume", {"policy_version": "v2"})[0] == 200


def _cut(proxy, episode: str, at: int = 12, **request) -> list:
    """A chat stream of CONTENT, cut by a weight sync once its ``at``-th chunk is in;
    the chunks the client got."""
    extra = request.pop("extra_body", {})
    client = openai.OpenAI(base_url=proxy.episode_url(episode), api_key="x", max_retries=0)
    with client:
        stream = client.chat.completions.create(
            model="mock-model", messages=MESSAGES, stream=True,
            extra_body={"mock_content": CONTENT, "mock_chunk_delay_s": 0.03, **extra},
            **request)
        chunks = []
        for i, chunk in enumerate(stream):
            chunks.append(chunk)
            if i == at:
                _weight_sync(proxy)
    return chunks


def _text(chunks) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _split(bodies, call) -> tuple[dict, dict, int]:
    """The first attempt's body, the continuation's, and how many ids came before the cut."""
    [(first_path, first), (path, continued)] = bodies
    assert (first_path, path) == ("/v1/chat/completions", "/v1/completions")
    [choice] = call["choices"]
    prompt = call["prompt_ids"]
    cut = len(continued["prompt"]) - len(prompt)
    assert 0 < cut < TOKENS - 1  # cut mid-answer
    assert continued["prompt"] == [*prompt, *choice["completion_ids"][:cut]]
    return first, continued, cut


def test_usage_after_a_continuation_counts_each_id_once(proxy, bodies):
    chunks = _cut(proxy, "u", max_tokens=200, stream_options={"include_usage": True})
    assert _text(chunks) == CONTENT
    [call] = proxy.calls("u")
    [choice] = call["choices"]
    assert choice["completion_ids"] == [*CONTENT.encode(), EOS]
    usage = chunks[-1].usage
    # What the client is told, what is stored, what budgets and metrics are fed.
    assert usage.completion_tokens == TOKENS == call["completion_tokens"]
    assert usage.prompt_tokens == len(call["prompt_ids"]) == call["prompt_tokens"]
    assert usage.total_tokens == usage.prompt_tokens + TOKENS
    metrics = proxy.state.metrics.render().decode()
    assert f'tracetap_tokens_total{{model="mock-model",type="completion"}} {TOKENS}.0' in metrics
    proxy.loop.run(proxy.state.budgets.settled())
    spent = proxy.loop.run(budget_ledger.spent(proxy.state.engine, "u"))
    assert (spent.tokens_used, spent.tokens_reserved) == (call["prompt_tokens"] + TOKENS, 0)
    _split(bodies, call)


def test_the_continuation_body_field_by_field(proxy, bodies):
    chunks = _cut(proxy, "b", max_tokens=200, logprobs=True, top_logprobs=2,
                  extra_body={**SAMPLING, "min_tokens": 40})
    assert _text(chunks) == CONTENT
    [call] = proxy.calls("b")
    first, continued, cut = _split(bodies, call)
    assert first == {"model": "mock-model", "messages": MESSAGES, "max_tokens": 200,
                     "stream": True, "logprobs": True, "top_logprobs": 2,
                     "mock_content": CONTENT, "mock_chunk_delay_s": 0.03, **SAMPLING,
                     "min_tokens": 40, "stream_options": {"include_usage": True},
                     "return_token_ids": True}
    assert continued == {
        "model": "mock-model", **SAMPLING,
        "mock_content": CONTENT, "mock_chunk_delay_s": 0.03,
        "prompt": continued["prompt"],  # checked in _split: the prompt ids + the partial
        "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True},
        "max_tokens": 200 - cut,  # what is left of the cap
        "min_tokens": 40 - cut,  # and of the floor
        "logprobs": 2,  # the client's top_logprobs, as completions spell it
    }
    # The client's logprobs: one entry per token, with its 2 alternatives, all along.
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert len(entries) == TOKENS and all(len(e.top_logprobs) == 2 for e in entries)


@pytest.mark.parametrize("cap", [{"max_completion_tokens": 150}, {}])
def test_the_continuation_keeps_what_is_left_of_the_cap(proxy, bodies, cap):
    chunks = _cut(proxy, "m", extra_body=cap)
    assert _text(chunks) == CONTENT
    [call] = proxy.calls("m")
    _, continued, cut = _split(bodies, call)
    if cap:
        assert continued["max_tokens"] == 150 - cut
    else:
        assert "max_tokens" not in continued  # the engine's own default, as first asked
    assert continued["logprobs"] == 1  # asked by the proxy for capture only
    assert not any(c.choices[0].logprobs for c in chunks if c.choices)


def test_a_request_with_tools_is_never_continued(proxy, bodies):
    """Even when the answer so far is plain text: the engine's tool parser would turn a
    later tool call into ``tool_calls``, which a raw continuation would not."""
    tools = [{"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]
    chunks = _cut(proxy, "t", tools=tools, max_tokens=200,
                  extra_body={"mock_tool_rounds": 0})
    assert _text(chunks) == CONTENT
    assert [p for p, _ in bodies] == ["/v1/chat/completions"]  # finished, not cut
    [call] = proxy.calls("t")
    assert call["status"] == "ok"
    assert call["choices"][0]["completion_ids"] == [*CONTENT.encode(), EOS]


@pytest.mark.parametrize("constraint", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
    {"guided_regex": ".*"}, {"structured_outputs": {"regex": ".*"}},
])
def test_structured_output_is_never_continued(proxy, bodies, constraint):
    """A token-id prompt would start the grammar again at the cut."""
    chunks = _cut(proxy, "s", max_tokens=200, extra_body=constraint)
    assert _text(chunks) == CONTENT
    assert [p for p, _ in bodies] == ["/v1/chat/completions"]  # finished, not cut


@pytest.mark.parametrize("field,value", [
    ("max_tokens", "100"), ("max_tokens", 12.5), ("max_tokens", -1), ("max_tokens", True),
    ("max_completion_tokens", "100"), ("max_completion_tokens", [1]), ("n", "1"),
    ("min_tokens", "4"),
    ("top_logprobs", "2"),
])
def test_a_bad_typed_field_the_continuation_reads_is_refused_at_parse_time(
        proxy, bodies, field, value):
    client = openai.OpenAI(base_url=proxy.episode_url("bad"), api_key="x", max_retries=0)
    with client, pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="mock-model", messages=MESSAGES, stream=True,
                                       extra_body={field: value, "mock_content": CONTENT})
    assert refused.value.body["code"] == f"invalid_{field}"
    assert field in refused.value.body["message"]
    assert bodies == []
