"""Token ids from engines that do not return them, through the proxy, with the real SDK.

The mock engine plays llama.cpp's llama-server (completion ids only inside logprob
entries), llama-cpp-python (no ids at all: token strings, /extras/tokenize) and vLLM
asked for no ids (token strings, /tokenize with messages). The proxy fills in what is
missing from the engine's own tokenizer, in the writer, and keeps out what it cannot
verify.
"""

from __future__ import annotations

import asyncio
import json
import logging

import openai
import pyarrow.parquet as pq
import pytest
from aiohttp import web
from helpers.http import metrics_text, post
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap import cli
from tracetap.demo import tokenizer as tok
from tracetap.demo.engine import EngineConfig, make_engine_app
from tracetap.exporters import export
from tracetap.proxy.runtime.settings import Settings
from tracetap.proxy.tokens.resolve import REMEDIES
from tracetap.storage.records import IDS_MISSING

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]


def admin(proxy, method: str, path: str, body: dict | None = None) -> dict:
    status, reply = proxy.admin(method, path, body or {})
    assert status < 300, reply
    return reply


def chat_loop(proxy, episode: str, turns: int, **kwargs) -> list[dict]:
    """A tool-using harness: resends the history as returned, streams every other turn."""
    client = openai.OpenAI(base_url=proxy.episode_url(episode), api_key="x", max_retries=0)
    messages: list[dict] = [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": f"Solve {episode}."}]
    with client:
        for i in range(turns):
            if i % 2:
                content, calls = "", {}
                with client.chat.completions.create(model="m", messages=messages, stream=True,
                                                    **kwargs) as chunks:
                    for chunk in chunks:
                        for choice in chunk.choices:
                            content += choice.delta.content or ""
                            for c in choice.delta.tool_calls or ():
                                call = calls.setdefault(c.index, {"id": c.id, "type": "function",
                                                                  "function": {"name": "",
                                                                               "arguments": ""}})
                                call["function"]["name"] += c.function.name or ""
                                call["function"]["arguments"] += c.function.arguments or ""
                tool_calls = [calls[k] for k in sorted(calls)]
            else:
                message = client.chat.completions.create(model="m", messages=messages,
                                                         **kwargs).choices[0].message
                content = message.content or ""
                tool_calls = [c.model_dump(include={"id", "type", "function"})
                              for c in message.tool_calls or ()]
            assistant = {"role": "assistant", "content": content or None}
            if tool_calls:
                assistant["tool_calls"] = tool_calls
            messages.append(assistant)
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": "found it"}
                         for c in tool_calls]
            if not tool_calls:
                messages.append({"role": "user", "content": "And then?"})
    return proxy.calls(episode)


def export_rows(proxy, tmp_path, episode: str) -> tuple[list[dict], object]:
    admin(proxy, "POST", f"/tracetap/episodes/{episode}/finish", {"reward": 1.0})
    summary = export(proxy.settings.db, tmp_path / "out")
    rows = [r for r in pq.read_table(tmp_path / "out" / "trajectories").to_pylist()
            if r["episode_id"] == episode]
    return rows, summary


def engine_ids(engine_url: str, request: dict) -> tuple[list[int], list[int]]:
    """What the engine itself tokenizes for ``request`` (the mock's own vLLM answer)."""
    body = {**request, "return_token_ids": True, "stream": False}
    body.pop("stream_options", None)
    status, data = post(engine_url + "/chat/completions", body)
    assert status == 200, data
    return data["prompt_token_ids"], data["choices"][0]["token_ids"]


def missing_metric(proxy) -> dict[str, float]:
    text = metrics_text(proxy.url)
    out = {}
    for line in text.splitlines():
        if line.startswith("tracetap_token_ids_missing_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('reason="')[1].split('"')[0]] = float(value)
    return out


# ---- llama-server: completion ids in logprobs, prompt ids from /apply-template ---------------

@pytest.mark.parametrize("engine_config", [EngineConfig(flavor="llama-server")])
def test_llama_server_episode_is_one_trajectory_of_engine_exact_ids(proxy, tmp_path):
    calls = chat_loop(proxy, "ls", 4, tools=TOOLS)
    assert len(calls) == 4
    for call in calls:
        request = json.loads(call["request"])
        # Rendered by the engine's template, tokenized by its tokenizer: its own prompt.
        assert call["prompt_ids"] == tok.apply_chat_template(request["messages"], TOOLS)
        assert call["prompt_source"] == "engine_tokenize" and call["ids_missing"] is None
        [choice] = call["choices"]
        assert choice["token_source"] == "logprobs"
        assert tok.decode(choice["completion_ids"]).startswith(choice["text"] or "")
    rows, summary = export_rows(proxy, tmp_path, "ls")
    [row] = rows
    assert row["num_turns"] == 4 and row["split_reason"] is None and not summary.left_out
    last = calls[-1]
    assert row["prompt_ids"] + row["response_ids"] == (
        last["prompt_ids"] + last["choices"][0]["completion_ids"])


# ---- llama-cpp-python: no ids at all ----------------------------------------------------------

@pytest.mark.parametrize("engine_config", [EngineConfig(flavor="llama-cpp-python")])
def test_llama_cpp_python_completions_harness_gets_a_whole_trajectory(proxy, tmp_path):
    client = openai.OpenAI(base_url=proxy.episode_url("lcp"), api_key="x", max_retries=0)
    prompt = "<|im_start|>user\nTell me.<|im_end|>\n<|im_start|>assistant\n"
    texts = []
    with client:
        for i in range(3):
            if i == 1:
                text = "".join(c.choices[0].text for c in client.completions.create(
                    model="m", prompt=prompt, stream=True))
            else:
                text = client.completions.create(model="m", prompt=prompt).choices[0].text
            texts.append((prompt, text))
            prompt += text + "<|im_end|>\n<|im_start|>user\nMore.<|im_end|>\n"
            prompt += "<|im_start|>assistant\n"
    calls = proxy.calls("lcp")
    for call, (sent, text) in zip(calls, texts, strict=True):
        assert call["prompt_ids"] == tok.encode(sent)  # /extras/tokenize: the engine's own
        assert call["prompt_source"] == "engine_tokenize"
        [choice] = call["choices"]
        # llama-cpp-python stops before the EOS: the ids are the text's, verified piecewise.
        assert choice["completion_ids"] == tok.encode(text)
        assert choice["token_source"] == "verified_retokenized"
        assert len(choice["completion_logprobs"]) == len(choice["completion_ids"])
    rows, summary = export_rows(proxy, tmp_path, "lcp")
    [row] = rows
    assert row["num_turns"] == 3 and not summary.left_out
    assert sum(row["response_mask"]) == sum(len(tok.encode(t)) for _, t in texts)


@pytest.mark.parametrize("engine_config", [EngineConfig(flavor="llama-cpp-python")])
def test_llama_cpp_python_chat_completions_verified_prompts_left_out(proxy, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="tracetap.resolve")
    calls = chat_loop(proxy, "lcp-chat", 3)
    for call in calls:
        assert call["prompt_ids"] is None and call["prompt_source"] == "none"
        assert call["ids_missing"] == "no_chat_template"
        [choice] = call["choices"]
        assert choice["completion_ids"] == tok.encode(choice["text"])
        assert choice["token_source"] == "verified_retokenized"
    assert missing_metric(proxy) == {"no_chat_template": 3.0}
    warned = [r for r in caplog.records if "no_chat_template" in r.getMessage()]
    assert len(warned) == 1 and "llama-server" in warned[0].getMessage()  # once, with the remedy
    rows, summary = export_rows(proxy, tmp_path, "lcp-chat")
    assert rows == [] and summary.left_out == {"no_chat_template": 3}


@pytest.mark.parametrize("engine_config", [EngineConfig(flavor="llama-cpp-python")])
@pytest.mark.parametrize("content", ["<tool_call>", "Caf\u00e9 au lait."],
                         ids=["special-token-spelled-in-bytes", "split-character"])
def test_a_completion_that_does_not_retokenize_one_for_one_is_rejected(proxy, content):
    client = openai.OpenAI(base_url=proxy.episode_url("amb"), api_key="x", max_retries=0)
    with client:
        for text in (content, "Plain words."):
            client.completions.create(model="m", prompt="Say it:",
                                      extra_body={"mock_content": text})
    rejected, control = proxy.calls("amb")
    # "<tool_call>" sampled byte by byte tokenizes to one special token; "é" is two byte
    # tokens the engine shows as "" each: either way the pieces do not match, so no ids.
    assert rejected["choices"][0]["text"] == content
    assert rejected["choices"][0]["completion_ids"] is None
    assert rejected["choices"][0]["token_source"] == "none"
    assert rejected["ids_missing"] == "unverified" and rejected["prompt_ids"] is not None
    assert control["choices"][0]["completion_ids"] == tok.encode("Plain words.")
    assert missing_metric(proxy) == {"unverified": 1.0}


# ---- vLLM asked for no ids: /tokenize with the messages, /detokenize for pieces ---------------

@pytest.fixture
def proxy_settings(engine, db_url, tmp_path, request) -> Settings:
    flavor = getattr(request, "param", "auto")
    return Settings(upstream=engine.url, db=db_url, data_dir=str(tmp_path / "data"),
                    port=free_port(), upstream_flavor=flavor)


@pytest.mark.parametrize("proxy_settings", ["openai"], indirect=True)
def test_vllm_without_return_token_ids_recovers_the_engines_own_ids(proxy, engine, tmp_path):
    calls = chat_loop(proxy, "vl", 4, tools=TOOLS)
    for call in calls:
        request = json.loads(call["request"])
        prompt, completion = engine_ids(engine.url, request)
        [choice] = call["choices"]
        assert (call["prompt_ids"], choice["completion_ids"]) == (prompt, completion)
        assert (call["prompt_source"], choice["token_source"]) == (
            "engine_tokenize", "verified_retokenized")
    [row], summary = export_rows(proxy, tmp_path, "vl")
    assert row["num_turns"] == 4 and not summary.left_out


@pytest.mark.parametrize("engine_config", [EngineConfig(flavor="openai")])
def test_an_engine_without_ids_or_tokenizer_is_counted_and_logged_once(proxy, caplog):
    caplog.set_level(logging.WARNING, logger="tracetap.resolve")
    calls = chat_loop(proxy, "oa", 2)
    assert {c["ids_missing"] for c in calls} == {"no_tokenizer"}
    assert missing_metric(proxy) == {"no_tokenizer": 2.0}  # one per choice
    assert len([r for r in caplog.records if "no_tokenizer" in r.getMessage()]) == 1
    assert set(REMEDIES) == set(IDS_MISSING)  # a remedy for every reason stored


def test_the_agent_never_waits_for_the_tokenizer(loop_thread, db_url, tmp_path, serve_app):
    app = make_engine_app(EngineConfig(flavor="llama-cpp-python"))
    gate, entered = asyncio.Event(), asyncio.Event()

    @web.middleware
    async def held(request, handler):
        # The writer's questions about this call (not the probe at start, which finds
        # the endpoint before any call is in flight).
        if request.path.startswith("/extras/") and b"Hello" in await request.read():
            entered.set()
            await gate.wait()
        return await handler(request)

    app.middlewares.append(held)
    upstream = serve_app(app)
    settings = Settings(upstream=upstream + "/v1", db=db_url, data_dir=str(tmp_path / "data"),
                        port=free_port())
    proxy = Proxy(loop_thread, settings).start()
    try:
        client = openai.OpenAI(base_url=proxy.episode_url("held"), api_key="x", max_retries=0)
        with client:
            reply = client.completions.create(model="m", prompt="Hello")
        assert reply.choices[0].text
        # The reply is in hand while the writer's tokenize request is still held upstream.
        loop_thread.run(asyncio.wait_for(entered.wait(), 30))
        assert not gate.is_set()
        loop_thread.loop.call_soon_threadsafe(gate.set)
        [call] = proxy.calls("held")
        assert call["prompt_ids"] == tok.encode("Hello")
        assert call["choices"][0]["token_source"] == "verified_retokenized"
    finally:
        loop_thread.loop.call_soon_threadsafe(gate.set)
        proxy.stop()


@pytest.mark.parametrize("engine_config", [EngineConfig(flavor="openai")])
def test_export_command_says_how_many_were_left_out_and_why(proxy, tmp_path, capsys):
    chat_loop(proxy, "cli", 2)
    admin(proxy, "POST", "/tracetap/episodes/cli/finish", {"reward": 1.0})
    assert cli.main(["export", "--db", proxy.settings.db, "--out", str(tmp_path / "o"),
                     "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "left out of trajectories/: 2 completions without token ids (no_tokenizer: 2)" in out


def test_llama_cpp_python_streams_are_never_cut_by_the_writers_questions(
        loop_thread, db_url, tmp_path, serve_app):
    """llama-cpp-python ends a stream when another request arrives: the writer asks its
    tokenizer only while no call is in flight."""
    app = make_engine_app(EngineConfig(flavor="llama-cpp-python"))
    seen: list[tuple[str, float, float]] = []

    @web.middleware
    async def timed(request, handler):
        start = loop_thread.loop.time()
        try:
            return await handler(request)
        finally:
            seen.append((request.path, start, loop_thread.loop.time()))

    app.middlewares.append(timed)
    settings = Settings(upstream=serve_app(app) + "/v1", db=db_url, port=free_port(),
                        data_dir=str(tmp_path / "data"))
    proxy = Proxy(loop_thread, settings).start()
    try:
        proxy.state.writer.flush_interval = 0.5  # the first call's record lands mid-stream
        client = openai.OpenAI(base_url=proxy.episode_url("cut"), api_key="x", max_retries=0)
        with client:
            client.completions.create(model="m", prompt="First.")
            text = "".join(c.choices[0].text for c in client.completions.create(
                model="m", prompt="Second.", stream=True,
                extra_body={"mock_content": "y" * 40, "mock_chunk_delay_s": 0.03}))
        assert text == "y" * 40  # not cut short
        calls = proxy.calls("cut")
    finally:
        proxy.stop()
    assert [c["choices"][0]["token_source"] for c in calls] == ["verified_retokenized"] * 2
    [(_, start, end)] = [s for s in seen if s[0] == "/v1/completions" and s[2] - s[1] > 1]
    asked = [t for path, t, _ in seen if path.startswith("/extras/")]
    assert asked and not [t for t in asked if start <= t <= end]


# ---- an engine's tokenizer that disagrees with its own usage or strings ----------------------

def _skewed_engine(skew: str) -> web.Application:
    """The mock vLLM whose /tokenize is off: ``count`` adds a token to a chat prompt (its
    count is then not the engine's usage.prompt_tokens); ``prefix`` drops the last id of a
    text (retokenizing a completion then gives a strict prefix of the engine's tokens)."""
    app = make_engine_app(EngineConfig(flavor="vllm"))

    @web.middleware
    async def skewed(request, handler):
        response = await handler(request)
        if request.path != "/tokenize" or response.status != 200:
            return response
        asked, answer = await request.json(), json.loads(response.body)
        if skew == "count" and "messages" in asked:
            answer["tokens"].append(answer["tokens"][-1])
        elif skew == "prefix" and asked.get("prompt") not in (None, "hi") and len(
                answer["tokens"]) > 1:
            answer["tokens"].pop()
        else:
            return response
        answer["count"] = len(answer["tokens"])
        return web.json_response(answer)

    app.middlewares.append(skewed)
    return app


@pytest.mark.parametrize("skew", ["count", "prefix"])
def test_ids_the_engine_itself_would_not_give_are_not_stored(loop_thread, db_url, tmp_path,
                                                             serve_app, skew):
    """``count``: the engine's /tokenize gives one id more than the usage.prompt_tokens it
    reported; kills removing the prompt count check (``_keep_prompt``'s
    ``count_mismatch``). ``prefix``: retokenizing the completion gives a strict prefix of
    the engine's own tokens, every piece matching; kills removing the length check in
    ``_accept``, which ``zip`` would then truncate to fewer ids than tokens."""
    upstream = serve_app(_skewed_engine(skew)) + "/v1"
    settings = Settings(upstream=upstream, db=db_url, data_dir=str(tmp_path / "data"),
                        port=free_port(), upstream_flavor="openai")
    proxy = Proxy(loop_thread, settings).start()
    try:
        client = openai.OpenAI(base_url=proxy.episode_url("skew"), api_key="x",
                               max_retries=0)
        request = {"model": "m", "messages": [{"role": "user", "content": "Say it."}],
                   "max_tokens": 8}
        with client:
            reply = client.chat.completions.create(**request)
        [call] = proxy.calls("skew")
        metric = missing_metric(proxy)
    finally:
        proxy.stop()
    prompt, completion = engine_ids(upstream, request)
    assert reply.usage.prompt_tokens == len(prompt) and len(completion) > 1
    [choice] = call["choices"]
    if skew == "count":
        assert call["prompt_ids"] is None and call["ids_missing"] == "count_mismatch"
        assert choice["completion_ids"] == completion  # the completion still checks out
        assert metric == {"count_mismatch": 1.0}
    else:
        assert call["prompt_ids"] == prompt and call["prompt_source"] == "engine_tokenize"
        assert choice["completion_ids"] is None and choice["token_source"] == "none"
        assert call["ids_missing"] == "unverified" and metric == {"unverified": 1.0}
