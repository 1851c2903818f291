"""SGLang as an upstream: the mock engine's ``sglang`` flavor (SGLang 0.5.23's reply shapes,
demo/sglang.py) through the proxy, with the real openai SDK.

Each call's prompt and completion ids and logprobs are compared with what the engine
itself answers for the same request (a whole chat reply with ``return_token_ids``), so
"exact" means the engine's own ids and values, not the mock's internals.
"""

from __future__ import annotations

import asyncio
import json
import threading

import anthropic
import openai
import pytest
from aiohttp import web
from helpers.http import fetch, get, post
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.demo import tokenizer as tok
from tracetap.demo.engine import EngineConfig
from tracetap.demo.engine_common import ABORTS
from tracetap.demo.sglang import ABORTED
from tracetap.proxy.runtime.settings import Settings
from tracetap.proxy.tokens.engine_tokenizer import detect as detect_tokenizer
from tracetap.proxy.upstream.client import UpstreamClient

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."}]


@pytest.fixture
def engine_config() -> EngineConfig:
    return EngineConfig(flavor="sglang")


@pytest.fixture
def db_url(tmp_path, migrated_sqlite):
    return migrated_sqlite(tmp_path / "tracetap.db")  # the logic is the proxy's


def sse(raw: bytes) -> list[dict | str]:
    events = []
    for block in raw.decode().split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def engine_chat(engine, **extra) -> dict:
    """The engine's own whole reply, with its ids and logprobs."""
    body = {"model": "m", "messages": MESSAGES, "seed": 3, "max_tokens": 24,
            "return_token_ids": True, "logprobs": True, "top_logprobs": 0, **extra}
    status, reply = post(engine.url + "/chat/completions", body)
    assert status == 200, reply
    return reply


def engine_completion(engine, prompt: str) -> dict:
    body = {"model": "m", "prompt": prompt, "seed": 3, "max_tokens": 24,
            "return_token_ids": True, "logprobs": 0}
    status, reply = post(engine.url + "/completions", body)
    assert status == 200, reply
    return reply


# ---- the mock's shapes, as SGLang 0.5.23 writes them ---------------------------------------

def test_mock_sglang_chat_shapes(engine):
    whole = engine_chat(engine)
    [choice] = whole["choices"]
    assert choice["prompt_token_ids"] == tok.apply_chat_template(MESSAGES)
    assert len(choice["response_token_ids"]) == len(choice["logprobs"]["content"])
    assert "token_ids" not in choice and "prompt_token_ids" not in whole
    assert whole["id"] and not whole["id"].startswith("chatcmpl-")  # the request's rid
    # A stream refuses return_token_ids, in SGLang's own error shape.
    status, raw = fetch("POST", engine.url + "/chat/completions",
                        {"model": "m", "messages": MESSAGES, "stream": True,
                         "return_token_ids": True})
    error = json.loads(raw)
    assert (status, error["object"], error["code"]) == (400, "error", 400)
    # sglext: after each choice's finish chunk, before the usage chunk.
    status, raw = fetch("POST", engine.url + "/chat/completions", {
        "model": "m", "messages": MESSAGES, "seed": 3, "max_tokens": 24, "stream": True,
        "return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True,
        "stream_options": {"include_usage": True}})
    events = sse(raw)
    *_, finish, ext, usage, done = events
    assert finish["choices"][0]["delta"] == {"reasoning_content": None}
    assert finish["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert finish["choices"][0]["matched_stop"] == choice["matched_stop"]
    assert ext["choices"] == [] and ext["sglext"] == {
        "input_ids": choice["prompt_token_ids"], "output_ids": [choice["response_token_ids"]]}
    assert usage["usage"]["completion_tokens"] == len(choice["response_token_ids"])
    assert done == "[DONE]" and all("usage" not in e for e in events[:-4])


def test_mock_sglang_info_tokenizer_and_abort_endpoints(engine):
    assert get(engine.url + "/models")[1]["data"][0]["owned_by"] == "sglang"
    status, info = get(engine.base_url + "/get_model_info")
    assert status == 200 and info["is_generation"] is True and "model_path" in info
    status, out = post(engine.base_url + "/tokenize", {"prompt": "hi"})
    assert out == {"tokens": tok.encode("hi"), "count": 2, "max_model_len": 32768}
    assert post(engine.base_url + "/detokenize", {"tokens": [tok.EOS]})[1] == {"text": ""}
    kept = post(engine.base_url + "/detokenize",
                {"tokens": [tok.EOS], "skip_special_tokens": False})[1]
    assert kept == {"text": tok.decode([tok.EOS])}
    assert fetch("POST", engine.base_url + "/abort_request", {"rid": "x"})[0] == 200


# ---- through the proxy ----------------------------------------------------------------------

def _stream_chat(client, **kwargs) -> str:
    text = ""
    with client.chat.completions.create(model="m", messages=MESSAGES, stream=True, seed=3,
                                        max_tokens=24, **kwargs) as chunks:
        for chunk in chunks:
            assert chunk.choices, "no chunk without choices reaches a client that asked none"
            text += chunk.choices[0].delta.content or ""
    return text


def test_chat_ids_and_logprobs_exact_streamed_and_not(proxy, engine):
    truth = engine_chat(engine)["choices"][0]
    client = openai.OpenAI(base_url=proxy.episode_url("sg-chat"), api_key="x", max_retries=0)
    with client:
        whole = client.chat.completions.create(model="m", messages=MESSAGES, seed=3,
                                               max_tokens=24)
        streamed = _stream_chat(client)
        asked = client.chat.completions.create(model="m", messages=MESSAGES, seed=3,
                                               max_tokens=24, logprobs=True, top_logprobs=2)
    assert proxy.state.flavor == "sglang"  # detected
    assert whole.choices[0].message.content == streamed == truth["message"]["content"]
    assert whole.choices[0].logprobs is None  # the proxy's ask is not the client's answer
    assert len(asked.choices[0].logprobs.content[0].top_logprobs) == 2
    calls = proxy.calls("sg-chat")
    assert len(calls) == 3
    for call in calls:
        [choice] = call["choices"]
        assert call["prompt_ids"] == truth["prompt_token_ids"]
        assert choice["completion_ids"] == truth["response_token_ids"]
        logprobs = [e["logprob"] for e in truth["logprobs"]["content"]]
        assert choice["completion_logprobs"] == logprobs
        assert (call["prompt_source"], choice["token_source"]) == ("engine", "engine")


def test_client_gets_no_sglext_it_did_not_ask_for(proxy):
    url = proxy.episode_url("sg-raw")
    body = {"model": "m", "messages": MESSAGES, "seed": 3, "max_tokens": 8}
    status, raw = fetch("POST", url + "/chat/completions", body)
    assert status == 200 and "sglext" not in json.loads(raw)
    status, raw = fetch("POST", url + "/chat/completions", body | {"stream": True})
    events = sse(raw)
    assert status == 200 and events[-1] == "[DONE]"
    assert not any("sglext" in e or e.get("usage") for e in events[:-1])
    assert all(e["choices"] for e in events[:-1])


def test_completions_ids_and_logprobs_exact_streamed_and_not(proxy, engine):
    truth = engine_completion(engine, "Once upon")["choices"][0]
    client = openai.OpenAI(base_url=proxy.episode_url("sg-cmpl"), api_key="x", max_retries=0)
    with client:
        whole = client.completions.create(model="m", prompt="Once upon", seed=3, max_tokens=24)
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="m", prompt="Once upon", seed=3, max_tokens=24, stream=True) if c.choices)
    assert whole.choices[0].text == text
    for call in proxy.calls("sg-cmpl"):
        [choice] = call["choices"]
        assert call["prompt_ids"] == truth["prompt_token_ids"]
        assert choice["completion_ids"] == truth["token_ids"]
        assert choice["completion_logprobs"] == truth["logprobs"]["token_logprobs"]
        assert choice["token_source"] == "engine"


def test_a_stream_the_trainer_aborts_on_sglang_is_stored_as_far_as_it_went(proxy, engine):
    """slime / AReaL abort every request on the engine at a weight sync
    (``/abort_request {"abort_all": true}``): the cut answer is kept, token-exact."""
    client = openai.OpenAI(base_url=proxy.episode_url("sg-abort"), api_key="x", max_retries=0)
    text, reasons = "", []
    with client, client.chat.completions.create(
            model="m", messages=MESSAGES, stream=True, seed=3, max_tokens=200,
            extra_body={"mock_content": "x" * 150, "mock_chunk_delay_s": 0.01}) as chunks:
        for n, chunk in enumerate(chunks):
            text += chunk.choices[0].delta.content or ""
            reasons.append(chunk.choices[0].finish_reason)
            if n == 5:
                assert fetch("POST", engine.base_url + "/abort_request",
                             {"abort_all": True})[0] == 200
    assert reasons[-1] == "abort" and 0 < len(text) < 150
    [call] = proxy.calls("sg-abort")
    [choice] = call["choices"]
    assert choice["finish_reason"] == "abort" and choice["text"] == text
    assert choice["completion_ids"] == tok.encode(text)
    assert call["prompt_ids"] == tok.apply_chat_template(MESSAGES)


# ---- detection and the tokenizer ------------------------------------------------------------

def _behind_a_gateway(engine) -> web.Application:
    """SGLang behind a router that names itself the models' owner."""
    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "m", "owned_by": "router"}]})

    async def model_info(request):
        status, info = await asyncio.to_thread(get, engine.base_url + "/get_model_info")
        return web.json_response(info, status=status)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/get_model_info", model_info)
    return app


def test_sglang_detected_by_its_model_info(loop_thread, engine, serve_app, db_url, tmp_path):
    upstream = serve_app(_behind_a_gateway(engine))
    settings = Settings(upstream=upstream + "/v1", db=db_url, data_dir=str(tmp_path / "d"),
                        port=free_port(), upstream_flavor="auto")
    proxy = Proxy(loop_thread, settings).start()
    try:
        done = threading.Event()
        for _ in range(100):
            if proxy.state.flavor == "sglang":
                done.set()
                break
            done.wait(0.05)
        assert proxy.state.flavor == "sglang"
    finally:
        proxy.stop()


def test_engine_tokenizer_reads_sglangs_answers(loop_thread, engine):
    async def probe():
        client = UpstreamClient(timeout=5, connect_timeout=5, max_connections=4)
        await client.start()
        try:
            tokenizer, reached = await detect_tokenizer(client, engine.url)
            return (tokenizer.kind, reached, await tokenizer.piece(tok.EOS),
                    await tokenizer.chat_prompt({"messages": MESSAGES}))
        finally:
            await client.close()

    kind, reached, piece, prompt = loop_thread.run(probe())
    assert (kind, reached) == ("vllm", True)  # vLLM's requests; SGLang's answers
    assert piece == tok.token_bytes(tok.EOS)  # a special token's text, not skipped
    assert prompt == tok.apply_chat_template(MESSAGES)


# ---- a weight sync: SGLang's own abort, then the stream continued ------------------------------

CONTENT = "The quick brown fox jumps over the lazy dog, then rests by the river bank."


def test_a_weight_sync_aborts_an_sglang_stream_with_its_own_abort_and_continues_it(
        proxy, engine):
    """Closing the connection would lose the ids SGLang sends only as a chat stream ends:
    the proxy asks ``/abort_request`` for the stream's rid instead, takes the ids from the
    engine's ending (which the client never sees) and continues token for token."""
    assert proxy.admin("PUT", "/tracetap/policy", {"version": "v1"})[0] == 200
    client = openai.OpenAI(base_url=proxy.episode_url("sg-sync"), api_key="x", max_retries=0)
    app, synced, text, reasons = engine._runner.app, [], [], []

    def weight_sync():
        status, answer = proxy.admin("POST", "/tracetap/pause", {"mode": "abort", "timeout": 10})
        assert status == 200 and answer["drained"] is True
        assert app[ABORTED].count == 1 and app[ABORTS].count == 0  # asked, not disconnected
        assert proxy.admin("POST", "/tracetap/resume", {"policy_version": "v2"})[0] == 200
        synced.append(True)

    with client, client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=200, stream=True,
            extra_body={"mock_content": CONTENT, "mock_chunk_delay_s": 0.03}) as chunks:
        for i, chunk in enumerate(chunks):
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                reasons.append(choice.finish_reason)
            if i == 12:
                weight_sync()
    assert synced and "".join(text) == CONTENT  # one uninterrupted answer
    assert "abort" not in reasons and reasons[-1] == "stop"
    [call] = proxy.calls("sg-sync")
    [choice] = call["choices"]
    assert choice["completion_ids"] == [*CONTENT.encode(), tok.EOS]
    assert call["prompt_ids"] == tok.apply_chat_template(MESSAGES)
    assert len(choice["completion_logprobs"]) == len(choice["completion_ids"])
    assert call["status"] == "ok" and call["policy_version"] == "v1"


def test_messages_and_responses_translated_for_sglang_are_token_exact(proxy, engine):
    """Messages and Responses calls are translated to chat on SGLang, whose ids (in
    ``sglext``) are captured streamed or not."""
    truth = engine_chat(engine, max_tokens=64, seed=None)["choices"][0]
    agent = anthropic.Anthropic(base_url=proxy.url + "/episodes/sg-msg", api_key="x",
                                max_retries=0)
    with agent:
        got = agent.messages.create(model="m", max_tokens=64, system=MESSAGES[0]["content"],
                                    messages=MESSAGES[1:])
        with agent.messages.stream(model="m", max_tokens=64, system=MESSAGES[0]["content"],
                                   messages=MESSAGES[1:]) as stream:
            streamed = stream.get_final_message()
    assert got.content[0].text == streamed.content[0].text == truth["message"]["content"]
    client = openai.OpenAI(base_url=proxy.episode_url("sg-msg"), api_key="x", max_retries=0)
    with client:
        whole = client.responses.create(model="m", instructions=MESSAGES[0]["content"],
                                        input=MESSAGES[1]["content"], max_output_tokens=64)
        with client.responses.stream(model="m", instructions=MESSAGES[0]["content"],
                                     input=MESSAGES[1]["content"], max_output_tokens=64) as s:
            streamed = s.get_final_response()
    assert whole.output_text == streamed.output_text == truth["message"]["content"]
    calls = proxy.calls("sg-msg")
    assert [c["endpoint"] for c in calls] == ["messages:chat"] * 2 + ["responses:chat"] * 2
    for call in calls:
        assert call["prompt_ids"] == truth["prompt_token_ids"]
        assert call["choices"][0]["completion_ids"] == truth["response_token_ids"]
