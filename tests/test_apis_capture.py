"""Responses and Messages harnesses through the proxy: native capture and translation to
chat completions, with the official ``openai`` and ``anthropic`` SDKs as the agents.

The mock engine renders all three APIs through the same chat template and generator, so
a conversation has one true token sequence whichever API carried it: the stored ids and
logprobs are compared with what the engine's own chat path returns for it.
"""

from __future__ import annotations

import itertools
import json
import socket
import time

import anthropic
import msgspec
import openai
import pytest
from aiohttp import web
from helpers.chat_upstreams import scripted_chat_app
from helpers.http import fetch
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.demo.engine import EngineConfig, EngineServer, make_engine_app
from tracetap.proxy.runtime.settings import Settings

TOOLS_RESPONSES = [{"type": "function", "name": "lookup", "description": "look a fact up",
                    "parameters": {"type": "object", "properties": {"step": {"type": "integer"}},
                                   "required": ["step"]}}]
TOOLS_MESSAGES = [{"name": "lookup", "description": "look a fact up",
                   "input_schema": {"type": "object", "properties": {"step": {"type": "integer"}},
                                    "required": ["step"]}}]


class FakeEngine:
    def __init__(self, url: str):
        self.url = url


@pytest.fixture
def make_proxy(loop_thread, tmp_path, migrated_sqlite):
    started = []

    def start(engine: EngineServer, **settings) -> Proxy:
        db = migrated_sqlite(tmp_path / f"p{len(started)}.db")
        proxy = Proxy(loop_thread, Settings(
            upstream=engine.url, db=db, data_dir=str(tmp_path / f"d{len(started)}"),
            port=free_port(), **settings)).start()
        started.append(proxy)
        return proxy

    yield start
    for proxy in started:
        proxy.stop()


@pytest.fixture
def llamacpp(loop_thread):
    """A chat-only engine: no /v1/responses, no /v1/messages."""
    server = EngineServer(EngineConfig(flavor="llamacpp"))
    loop_thread.run(server.start())
    yield server
    loop_thread.run(server.close())


def _chat_truth(engine: EngineServer, messages: list, **extra) -> tuple[list[int], list[float]]:
    """What the engine's own chat path gives for a conversation: completion ids, logprobs."""
    client = openai.OpenAI(base_url=engine.url, api_key="x", max_retries=0)
    with client:
        reply = client.chat.completions.create(
            model="mock-model", messages=messages, logprobs=True, top_logprobs=0,
            extra_body={"return_token_ids": True, **extra})
    choice = reply.choices[0]
    return choice.token_ids, [e.logprob for e in choice.logprobs.content]


def _assert_one_token_sequence(stored: list[dict]) -> None:
    """Each turn's prompt starts with the previous prompt + completion, token for token:
    the calls merge into one trajectory, as a chat harness's do."""
    for before, after in itertools.pairwise(stored):
        head = before["prompt_ids"] + before["choices"][0]["completion_ids"]
        assert after["prompt_ids"][:len(head)] == head


def _without_ids(obj) -> dict:
    data = obj.model_dump()
    for key in ("id", "created_at"):
        data.pop(key, None)
    for item in data.get("output") or ():
        item.pop("id", None)
    return data


def test_responses_native_on_vllm_is_transparent_and_token_exact(engine, make_proxy):
    proxy = make_proxy(engine, upstream_flavor="vllm")
    direct = openai.OpenAI(base_url=engine.url, api_key="x", max_retries=0)
    agent = openai.OpenAI(base_url=proxy.episode_url("r1"), api_key="x", max_retries=0)
    with direct, agent:
        want = direct.responses.create(model="mock-model", input="hello there", store=False)
        got = agent.responses.create(model="mock-model", input="hello there", store=False)
        with agent.responses.stream(model="mock-model", input="hello there") as stream:
            streamed = stream.get_final_response()
    assert _without_ids(got) == _without_ids(want)
    assert streamed.output_text == want.output_text
    # Nothing the proxy asked for reaches the client.
    assert got.output[0].content[0].logprobs is None and got.top_logprobs is None
    assert streamed.output[0].content[0].logprobs is None
    ids, logprobs = _chat_truth(engine, [{"role": "user", "content": "hello there"}])
    calls = proxy.calls("r1")
    assert [c["endpoint"] for c in calls] == ["responses", "responses"]
    for call in calls:
        choice = call["choices"][0]
        assert choice["completion_ids"] == ids
        assert choice["completion_logprobs"] == pytest.approx(logprobs)
        assert choice["token_source"] == "engine" and call["status"] == "ok"
        assert call["prompt_ids"] and call["prompt_tokens"] == len(call["prompt_ids"])
        assert "input_messages" not in (call["response"] or "") or '"input_messages":null' in \
            call["response"].replace(" ", "")


@pytest.mark.parametrize("translate", ["all", "auto", "auto-vllm"])
def test_responses_translated_to_chat_tool_loop_is_token_exact(engine, llamacpp, make_proxy,
                                                               translate):
    """A tool loop as langchain's use_responses_api runs it. On vLLM under auto, native
    Responses would store the tool-call-only turns without logprobs: they are translated,
    so every turn is trainable."""
    upstream = llamacpp if translate == "auto" else engine  # auto: chat-only engine
    if translate == "auto-vllm":
        proxy = make_proxy(upstream, translate="auto", upstream_flavor="vllm")
    else:
        proxy = make_proxy(upstream, translate=translate)
    agent = openai.OpenAI(base_url=proxy.episode_url("rt"), api_key="x", max_retries=0)
    items: list = [{"role": "user", "content": "find the answer"}]
    with agent:
        for turn in range(3):
            kwargs = dict(model="mock-model", input=items, tools=TOOLS_RESPONSES,
                          extra_body={"mock_tool_rounds": 2} if turn == 0 else {})
            if turn == 1:
                with agent.responses.stream(**kwargs) as stream:
                    reply = stream.get_final_response()
            else:
                reply = agent.responses.create(**kwargs)
            calls = [o for o in reply.output if o.type == "function_call"]
            if not calls:
                assert reply.output_text
                break
            # As the Agents SDK does: every output item back, then the tool results.
            items.extend(o.model_dump(exclude_none=True) for o in reply.output)
            items.extend({"type": "function_call_output", "call_id": c.call_id, "output": "42"}
                         for c in calls)
    stored = proxy.calls("rt")
    assert len(stored) == 3
    assert {c["endpoint"] for c in stored} == {"responses:chat"}
    assert all(c["choices"][0]["completion_ids"] for c in stored)
    if translate == "auto":
        return  # llama.cpp gives no prompt ids and no logprobs at top_logprobs 0
    assert all(c["choices"][0]["completion_logprobs"] for c in stored)
    _assert_one_token_sequence(stored)


def test_messages_default_to_translation_and_are_token_exact(engine, make_proxy):
    proxy = make_proxy(engine, upstream_flavor="vllm")
    agent = anthropic.Anthropic(base_url=proxy.url + "/episodes/m1", api_key="x",
                                max_retries=0)
    messages = [{"role": "user", "content": "hello there"}]
    with agent:
        got = agent.messages.create(model="mock-model", max_tokens=64, messages=messages,
                                    system="be brief")
        with agent.messages.stream(model="mock-model", max_tokens=64, messages=messages,
                                   system="be brief") as stream:
            streamed = stream.get_final_message()
    assert got.content[0].type == "text" and got.content[0].text
    assert streamed.content[0].text == got.content[0].text
    assert got.usage.input_tokens > 0 and got.usage.output_tokens > 0
    ids, logprobs = _chat_truth(engine, [{"role": "system", "content": "be brief"}, *messages],
                                max_tokens=64)
    stored = proxy.calls("m1")
    assert [c["endpoint"] for c in stored] == ["messages:chat"] * 2
    for call in stored:
        assert call["choices"][0]["completion_ids"] == ids
        assert call["choices"][0]["completion_logprobs"] == pytest.approx(logprobs)
        assert call["http_status"] == 200


def test_messages_tool_use_round_trip_keeps_one_token_sequence(engine, make_proxy):
    proxy = make_proxy(engine)
    status, created = proxy.admin("POST", "/tracetap/episodes", {"id": "mt"})
    assert status == 201
    # The minted key, sent the Anthropic way (x-api-key), tags the episode.
    agent = anthropic.Anthropic(base_url=proxy.url, api_key=created["api_key"], max_retries=0)
    messages: list = [{"role": "user", "content": "find the answer"}]
    with agent:
        for _ in range(4):
            reply = agent.messages.create(model="mock-model", max_tokens=256, tools=TOOLS_MESSAGES,
                                          messages=messages)
            messages.append({"role": "assistant",
                             "content": [b.model_dump(exclude_none=True) for b in reply.content]})
            uses = [b for b in reply.content if b.type == "tool_use"]
            if reply.stop_reason != "tool_use":
                break
            assert uses and uses[0].name == "lookup"
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": "42"} for u in uses]})
    stored = proxy.calls("mt")
    assert len(stored) == 3 and reply.stop_reason == "end_turn"
    _assert_one_token_sequence(stored)


def test_messages_native_when_asked_stores_text_without_ids(engine, make_proxy):
    proxy = make_proxy(engine, translate="none")
    agent = anthropic.Anthropic(base_url=proxy.url + "/episodes/mn", api_key="x",
                                max_retries=0)
    with agent, agent.messages.stream(model="mock-model", max_tokens=32,
                                      messages=[{"role": "user", "content": "hi"}]) as stream:
        text = stream.get_final_text()
    (call,) = proxy.calls("mn")
    assert call["endpoint"] == "messages" and call["status"] == "ok"
    assert call["choices"][0]["text"] == text and call["choices"][0]["token_source"] == "none"


def test_untranslatable_and_upstream_errors_come_in_the_clients_shape(engine, make_proxy,
                                                                     serve_app):
    proxy = make_proxy(engine)
    async def fall_over(request: web.Request) -> web.Response:
        return web.json_response(
            {"error": {"message": "engine fell over", "type": "server_error"}}, status=500)

    failing = web.Application()
    failing.router.add_post("/v1/chat/completions", fall_over)
    broken = make_proxy(FakeEngine(serve_app(failing) + "/v1"))
    agent = anthropic.Anthropic(base_url=proxy.url + "/episodes/bad", api_key="x",
                                max_retries=0)
    responses = openai.OpenAI(base_url=proxy.episode_url("bad"), api_key="x", max_retries=0)
    with agent, responses:
        with pytest.raises(anthropic.BadRequestError) as server_tool:
            agent.messages.create(model="mock-model", max_tokens=16,
                                  messages=[{"role": "user", "content": "hi"}],
                                  extra_body={"mcp_servers": [{"type": "url", "name": "m",
                                                               "url": "http://x"}]})
        assert server_tool.value.body["type"] == "error"
        on_broken = anthropic.Anthropic(base_url=broken.url + "/episodes/bad", api_key="x",
                                        max_retries=0)
        with on_broken, pytest.raises(anthropic.InternalServerError, match="engine fell over"):
            on_broken.messages.create(model="mock-model", max_tokens=16,
                                      messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError):  # no response store upstream
            responses.responses.create(model="mock-model", input="hi",
                                       previous_response_id="resp_1")
    assert sorted(c["http_status"] for c in proxy.calls("bad")) == [400, 400]
    assert [c["http_status"] for c in broken.calls("bad")] == [500]


def test_model_map_sends_the_engines_model(engine, make_proxy):
    proxy = make_proxy(engine, model_map=["claude-*=mock-model"])
    agent = anthropic.Anthropic(base_url=proxy.url + "/episodes/mm", api_key="x",
                                max_retries=0)
    with agent:
        reply = agent.messages.create(model="claude-harness-model", max_tokens=16,
                                      messages=[{"role": "user", "content": "hi"}])
    assert reply.content
    (call,) = proxy.calls("mm")
    assert call["model"] == "mock-model"


def test_a_translated_stream_is_written_from_the_request(engine, make_proxy):
    """The Messages stream's message is built from the request (its model), not only
    from the engine's chunks."""
    proxy = make_proxy(engine)
    agent = anthropic.Anthropic(base_url=proxy.url + "/episodes/mms", api_key="x",
                                max_retries=0)
    with agent, agent.messages.stream(model="mock-model", max_tokens=16,
                                      messages=[{"role": "user", "content": "hi"}]) as stream:
        message = stream.get_final_message()
    assert message.content and message.model == "mock-model"


def test_auto_translates_after_the_upstream_answers_404(make_proxy, serve_app):
    """A server announced as vLLM that lacks /v1/responses: the first call is sent again
    as chat, and the ones after it go straight to chat."""
    seen: list[str] = []

    @web.middleware
    async def record(request, handler):
        seen.append(request.path)
        return await handler(request)

    app = make_engine_app(EngineConfig(flavor="llamacpp"))
    app.middlewares.append(record)
    proxy = make_proxy(FakeEngine(serve_app(app) + "/v1"), upstream_flavor="vllm")
    agent = openai.OpenAI(base_url=proxy.episode_url("fb"), api_key="x", max_retries=0)
    with agent:
        first = agent.responses.create(model="mock-model", input="hello")
        second = agent.responses.create(model="mock-model", input="hello")
    assert first.output_text and second.output_text == first.output_text
    assert [p for p in seen if p.startswith("/v1/")] == [
        "/v1/responses", "/v1/chat/completions", "/v1/chat/completions"]
    assert [c["endpoint"] for c in proxy.calls("fb")] == ["responses:chat"] * 2
    # The rerouted call's metrics are the new route's too.
    text = proxy.state.metrics.render().decode()
    assert 'tracetap_requests_total{code="200",route="responses"} 2.0' in text


def test_an_uncaptured_call_in_an_episode_still_shows_in_it(engine, make_proxy):
    proxy = make_proxy(engine)
    agent = anthropic.Anthropic(base_url=proxy.url + "/episodes/pt", api_key="x",
                                max_retries=0)
    with agent:
        counted = agent.messages.count_tokens(model="mock-model",
                                              messages=[{"role": "user", "content": "hi"}])
    assert counted.input_tokens > 0
    (call,) = proxy.calls("pt")
    assert call["endpoint"] == "/v1/messages/count_tokens"
    assert call["status"] == "passthrough" and call["http_status"] == 200
    text = proxy.state.metrics.render().decode()
    assert 'tracetap_requests_total{code="200",route="passthrough"} 1.0' in text


def _sse(kind: str, data: bytes) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


def test_unknown_and_malformed_events_are_relayed_as_sent_and_counted(make_proxy, serve_app):
    """A Responses upstream that adds a vendor event and one broken event."""
    completed = {"id": "resp_1", "object": "response", "status": "completed", "model": "m",
                 "output": [{"type": "message", "role": "assistant", "content": [
                     {"type": "output_text", "text": "hi", "logprobs": None}]}],
                 "usage": {"input_tokens": 3, "output_tokens": 1}}
    events = [
        _sse("response.created", b'{"type":"response.created","response":{"id":"resp_1"}}'),
        _sse("vendor.debug", b'{"type": "vendor.debug",   "note": "kept as is"}'),
        _sse("response.output_text.delta", b'{"type":"response.output_text.delta","delta":"hi"'),
        _sse("response.completed", msgspec.json.encode(
            {"type": "response.completed", "response": completed})),
    ]

    async def respond(request: web.Request) -> web.StreamResponse:
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        for event in events:
            await reply.write(event)
        await reply.write_eof()
        return reply

    app = web.Application()
    app.router.add_post("/v1/responses", respond)
    proxy = make_proxy(FakeEngine(serve_app(app) + "/v1"), upstream_flavor="vllm")
    got = http_post_stream(proxy.url + "/episodes/odd/v1/responses",
                           {"model": "m", "input": "hi", "stream": True})
    assert events[1] in got and events[2] in got  # byte for byte
    (call,) = proxy.calls("odd")
    assert call["status"] == "ok" and "unparseable upstream data" in call["error"]
    assert call["choices"][0]["text"] == "hi"
    text = proxy.state.metrics.render().decode()
    assert 'tracetap_unknown_stream_events_total{route="responses"} 1.0' in text


def http_post_stream(url: str, body: dict) -> bytes:
    status, raw = fetch("POST", url, msgspec.json.encode(body))
    assert status == 200, raw
    return raw


@pytest.fixture
def slow_engine(loop_thread):
    server = EngineServer(EngineConfig(flavor="vllm", chunk_delay_s=0.02))
    loop_thread.run(server.start())
    yield server
    loop_thread.run(server.close())


@pytest.mark.parametrize(("path", "body", "endpoint"), [
    ("/episodes/gone/v1/messages", {"model": "mock-model", "max_tokens": 256, "stream": True,
                                    "messages": [{"role": "user", "content": "x"}]},
     "messages:chat"),
    ("/episodes/gone/v1/responses", {"model": "mock-model", "input": "x", "stream": True},
     "responses"),
])
def test_a_client_gone_mid_stream_leaves_the_partial_call(slow_engine, make_proxy, path, body,
                                                          endpoint):
    proxy = make_proxy(slow_engine)
    payload = msgspec.json.encode(body)
    with socket.create_connection(("127.0.0.1", proxy.settings.port)) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        received = b""
        while received.count(b"event: ") < 6:
            received += sock.recv(65536)
    deadline = time.monotonic() + 20
    while not (calls := proxy.calls("gone")):
        assert time.monotonic() < deadline, "the partial call was never stored"
        time.sleep(0.05)  # the handler finishes when it notices the client is gone
    (call,) = calls
    assert call["endpoint"] == endpoint and call["status"] == "client_disconnected"
    if endpoint == "messages:chat":  # through chat: the tokens so far, exactly
        ids = call["choices"][0]["completion_ids"]
        assert ids and len(call["choices"][0]["completion_logprobs"]) == len(ids)


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_reasoning_reaches_the_client_and_the_record_whichever_field(field, make_proxy,
                                                                     serve_app):
    """vLLM now streams ``reasoning`` where it sent ``reasoning_content``: capture and
    translation read it through the same decoders, so neither loses it."""
    chunks = [{"id": "chatcmpl-r", "created": 1, "model": "m", "choices": [
        {"index": 0, "delta": {field: piece}, "finish_reason": None}]}
        for piece in ("Weigh ", "it.")]
    chunks.append({"id": "chatcmpl-r", "created": 1, "model": "m", "choices": [
        {"index": 0, "delta": {"content": "Yes."}, "finish_reason": "stop"}]})
    upstream = serve_app(scripted_chat_app(chunks))
    proxy = make_proxy(FakeEngine(upstream + "/v1"), upstream_flavor="vllm")
    agent = anthropic.Anthropic(base_url=proxy.url + "/episodes/rf", api_key="x",
                                max_retries=0)
    with agent, agent.messages.stream(model="m", max_tokens=16,
                                      messages=[{"role": "user", "content": "?"}]) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in final.content] == [("thinking", "Weigh it."), ("text", "Yes.")]
    (call,) = proxy.calls("rf")
    stored = msgspec.json.decode(call["response"])
    assert stored["content"][0] == {"type": "thinking", "thinking": "Weigh it.",
                                    "signature": ""}



@pytest.mark.parametrize(("request_body", "translated"), [
    ({"input": "hi"}, False),
    ({"input": "hi", "tools": []}, False),
    ({"input": "hi", "reasoning": {"effort": "none"}}, False),
    ({"input": "hi", "tools": TOOLS_RESPONSES}, True),
    ({"input": "hi", "reasoning": {"effort": "low"}}, True),
    ({"input": "hi", "reasoning": {"summary": "auto"}}, True),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, True),
    ({"input": [{"type": "reasoning", "summary": []}, {"role": "user", "content": "go"}]},
     True),
])
def test_auto_picks_the_route_that_keeps_every_tokens_logprob(request_body, translated):
    from tracetap.proxy.apis.responses.capture import ResponsesApi
    from tracetap.proxy.apis.routing import Routing

    for translate, expect in (("auto", translated), ("none", False), ("all", True)):
        routing = Routing(translate, native={"responses": ResponsesApi()})
        route = routing.for_request(routing.route("/v1/responses", "vllm"), request_body)
        assert (route.endpoint == "responses:chat") is expect, (translate, request_body)


def test_sdk_streams_ending_on_length_keep_the_text_of_the_last_chunk(engine, make_proxy):
    """vLLM, and the mock engine playing it, send the last token's text in the chunk that
    carries ``finish_reason: length``. Translated by the proxy, the anthropic and openai
    SDKs' streams give all of it, as the whole replies do, and the record matches. Kills
    the Messages or Responses stream translator dropping the text of that chunk."""
    proxy = make_proxy(engine, translate="all", upstream_flavor="vllm")
    direct = openai.OpenAI(base_url=engine.url, api_key="x", max_retries=0)
    with direct, direct.chat.completions.create(
            model="mock-model", messages=[{"role": "user", "content": "hello there"}],
            max_tokens=5, stream=True) as chunks:
        ending = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert ending[0].finish_reason == "length" and ending[0].delta.content  # text with it

    messages = [{"role": "user", "content": "hello there"}]
    claude = anthropic.Anthropic(base_url=proxy.url + "/episodes/len-m", api_key="x",
                                 max_retries=0)
    with claude:
        whole = claude.messages.create(model="mock-model", max_tokens=5, messages=messages)
        with claude.messages.stream(model="mock-model", max_tokens=5,
                                    messages=messages) as stream:
            texts = list(stream.text_stream)
            streamed = stream.get_final_message()
    assert whole.stop_reason == streamed.stop_reason == "max_tokens"
    assert "".join(texts) == streamed.content[0].text == whole.content[0].text
    assert texts[-1] == ending[0].delta.content

    gpt = openai.OpenAI(base_url=proxy.episode_url("len-r"), api_key="x", max_retries=0)
    with gpt:
        whole_r = gpt.responses.create(model="mock-model", input=messages,
                                       max_output_tokens=5)
        with gpt.responses.stream(model="mock-model", input=messages,
                                  max_output_tokens=5) as stream:
            events = list(stream)  # get_final_response wants response.completed
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert events[-1].type == "response.incomplete"
    streamed_r = events[-1].response
    assert whole_r.status == streamed_r.status == "incomplete"
    assert "".join(deltas) == streamed_r.output_text == whole_r.output_text
    assert deltas[-1] == ending[0].delta.content

    for episode, text in (("len-m", whole.content[0].text), ("len-r", whole_r.output_text)):
        calls = proxy.calls(episode)
        assert [c["choices"][0]["text"] for c in calls] == [text, text]
        assert all(c["choices"][0]["finish_reason"] == "length" for c in calls)


# ---- native capture on its own: the events an upstream sends, and what is kept of them ----

def _feed(capture, *events) -> None:
    for event in events:
        capture.add(event if isinstance(event, bytes) else msgspec.json.encode(event))


def test_messages_capture_reassembles_a_stream_block_by_block():
    from tracetap.proxy.apis.messages.capture import MessagesApi, MessagesCapture
    from tracetap.proxy.http.sse import Event

    api = MessagesApi()
    assert (api.endpoint, api.route, api.path, api.ends_with_done) == (
        "messages", "messages", "/v1/messages", False)
    payload = {"model": "m", "messages": []}
    injected = api.prepare(payload, "vllm")
    assert payload == {"model": "m", "messages": []}  # nothing asked for
    assert api.strip_body(b'{"a": 1}', injected) == b'{"a": 1}'
    event = Event(raw=b"event: x\ndata: {}\n\n", data=b"{}")
    assert api.strip_event(event, injected) == event.raw
    assert not api.is_end(b'{"type": "message_stop"}')
    capture = api.capture(injected)
    assert type(capture) is MessagesCapture
    _feed(capture,
          {"type": "message_start", "message": {"id": "msg_1", "model": "claude", "usage": {
              "input_tokens": 9, "output_tokens": 1}}},
          {"type": "ping"},
          {"type": "content_block_start", "index": 0, "content_block": {
              "type": "thinking", "thinking": ""}},
          {"type": "content_block_delta", "index": 0, "delta": {"thinking": "hm"}},
          {"type": "content_block_delta", "index": 0, "delta": {"thinking": "m"}},
          {"type": "content_block_stop", "index": 0},
          {"type": "content_block_start", "index": 1, "content_block": {"type": "text",
                                                                        "text": ""}},
          {"type": "content_block_delta", "index": 1, "delta": {"text": "Hel"}},
          {"type": "content_block_delta", "index": 1, "delta": {"text": "lo"}},
          {"type": "content_block_start", "index": 2, "content_block": {
              "type": "tool_use", "id": "t1", "name": "f", "input": {}}},
          {"type": "content_block_delta", "index": 2, "delta": {"partial_json": '{"a"'}},
          {"type": "content_block_delta", "index": 2, "delta": {"partial_json": ": 1}"}},
          {"type": "content_block_delta", "index": 3, "delta": {"text": " again"}},
          {"type": "vendor_event"},
          {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
           "usage": {"output_tokens": 7}},
          {"type": "message_delta", "delta": {}})
    assert not capture.ended
    _feed(capture, {"type": "message_stop"})
    assert capture.ended and capture.unknown_events == 1 and capture.errors == []
    assert (capture.response_id, capture.model, capture.tokens()) == ("msg_1", "claude", (9, 7))
    [choice] = capture.choices()
    assert (choice.index, choice.finish_reason, choice.text) == (0, "tool_calls", "Hello again")
    assert (choice.completion_ids, choice.completion_logprobs, choice.top_logprobs,
            choice.token_source) == (None, None, None, "none")
    assert (capture.logprobs_missing, capture.choice_count) == (1, 1)
    message = capture.reassembled(with_logprobs=False)
    assert message == {
        "id": "msg_1", "model": "claude", "usage": {"input_tokens": 9, "output_tokens": 7},
        "stop_reason": "tool_use", "content": [
            {"type": "thinking", "thinking": "hmm"}, {"type": "text", "text": "Hello"},
            {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
            {"type": "text", "text": " again"}]}


@pytest.mark.parametrize(("stop", "finish"), [
    ("end_turn", "stop"), ("stop_sequence", "stop"), ("max_tokens", "length"),
    ("tool_use", "tool_calls"), ("refusal", "refusal"), (None, None)])
def test_messages_capture_of_a_whole_reply_names_the_finish_in_chats_words(stop, finish):
    from tracetap.proxy.apis.messages.capture import MessagesCapture

    capture = MessagesCapture()
    _feed(capture, {"type": "message", "id": "msg_2", "model": "c", "stop_reason": stop,
                    "usage": {"input_tokens": 3, "output_tokens": 2},
                    "content": [{"type": "text", "text": "a"}, {"type": "tool_use",
                                                                "input": {}},
                                {"type": "text", "text": "b"}]})
    [choice] = capture.choices()
    assert (choice.finish_reason, choice.text) == (finish, "ab")
    assert capture.tokens() == (3, 2) and capture.response_id == "msg_2"
    assert not capture.ended  # a whole reply is not a stream's end event


def test_messages_capture_keeps_what_it_can_of_a_broken_stream():
    from tracetap.proxy.apis.messages.capture import MessagesCapture

    capture = MessagesCapture()
    assert capture.choices()[0].text is None and capture.logprobs_missing == 0
    assert capture.tokens() == (None, None)
    capture.response_id, capture.model = "msg_x", "c"
    assert capture.reassembled(with_logprobs=True) == {
        "id": "msg_x", "type": "message", "role": "assistant", "model": "c", "content": [],
        "stop_reason": None, "usage": {}}
    _feed(capture, b"{not json",
          {"type": "message_start", "message": "not an object"},
          {"type": "content_block_delta", "delta": {"text": "x"}},  # no index, no start
          {"type": "content_block_start", "content_block": None},
          {"type": "content_block_delta", "index": 1, "delta": {"partial_json": "{broken"}},
          *({"type": "error", "error": {"type": "overloaded_error"}} for _ in range(6)))
    assert capture.errors[0].startswith("unparseable upstream data: ")
    assert capture.errors[1:] == ["upstream stream error: {'type': 'overloaded_error'}"] * 4
    assert capture.choices()[0].text == "x"
    content = capture.reassembled(with_logprobs=False)["content"]
    assert content == [{"type": "text", "text": "x"}, {"input": {}}]


def _response(**fields) -> dict:
    """A vLLM Responses reply as tracetap asked for it: logprobs and raw message tokens."""
    return {"id": "resp_9", "object": "response", "model": "m", "status": "completed",
            "usage": {"input_tokens": 4, "output_tokens": 2},
            "input_messages": [{"tokens": [1, 2]}, {"tokens": [3, 4]}],
            "output_messages": [{"tokens": [7, 8]}],
            "top_logprobs": 0,
            "output": [{"type": "reasoning", "content": [{"type": "reasoning_text"}]},
                       {"type": "message", "logprobs": [1], "content": [
                           {"type": "output_text", "text": "h", "logprobs": [
                               {"token": "h", "logprob": -0.5, "top_logprobs": [{"t": 1}]}]},
                           {"type": "refusal", "text": "no"},
                           {"type": "output_text", "text": "i", "logprobs": [
                               {"token": "i", "logprob": -0.25, "top_logprobs": []}]}]}],
            **fields}


def test_responses_prepare_asks_for_logprobs_and_ids_only_when_the_client_did_not():
    from tracetap.proxy.apis.responses.capture import LOGPROBS_INCLUDE, ResponsesApi

    api = ResponsesApi()
    assert (api.endpoint, api.route, api.path, api.ends_with_done) == (
        "responses", "responses", "/v1/responses", False)
    plain = {"input": "hi", "include": "not a list"}
    injected = api.prepare(plain, "vllm")
    assert plain["include"] == [LOGPROBS_INCLUDE] and plain["enable_response_messages"] is True
    assert (injected.logprobs, injected.top_logprobs_echo, injected.token_ids,
            injected.client_top_logprobs) == (True, True, True, 0)
    asked = {"input": "hi", "include": ["reasoning.encrypted_content", LOGPROBS_INCLUDE],
             "top_logprobs": 3, "enable_response_messages": True}
    injected = api.prepare(asked, "vllm")
    assert asked["include"] == ["reasoning.encrypted_content", LOGPROBS_INCLUDE]
    assert (injected.logprobs, injected.token_ids, injected.client_top_logprobs) == (
        False, False, 3)
    other = {"input": "hi", "top_logprobs": 0, "include": ["x"]}
    injected = api.prepare(other, "sglang")  # ids come only from vLLM
    assert other == {"input": "hi", "top_logprobs": 0, "include": ["x", LOGPROBS_INCLUDE]}
    assert injected.logprobs and not injected.top_logprobs_echo and not injected.token_ids
    assert not api.is_end(b'{"type": "response.completed"}')
    assert api.capture(injected).keep_top is False
    assert api.capture(api.prepare({"top_logprobs": 1, "include": [LOGPROBS_INCLUDE]},
                                   "vllm")).keep_top is True


def test_responses_replies_lose_only_what_the_proxy_asked_for():
    from tracetap.proxy.apis import Injected
    from tracetap.proxy.apis.responses.capture import ResponsesApi
    from tracetap.proxy.http.sse import Event

    api = ResponsesApi()
    both = Injected(logprobs=True, token_ids=True, top_logprobs_echo=True)
    stripped = msgspec.json.decode(api.strip_body(msgspec.json.encode(_response()), both))
    assert stripped["input_messages"] is None and stripped["output_messages"] is None
    assert stripped["top_logprobs"] is None
    message = stripped["output"][1]
    assert message["logprobs"] is None
    assert [p.get("logprobs") for p in message["content"]] == [None, None, None]
    assert stripped["output"][0] == _response()["output"][0]
    kept = msgspec.json.decode(api.strip_body(msgspec.json.encode(_response()),
                                              Injected(logprobs=True)))
    assert kept["input_messages"] == [{"tokens": [1, 2]}, {"tokens": [3, 4]}]
    assert kept["top_logprobs"] == 0  # the client set it: echoed as it is
    untouched = msgspec.json.decode(api.strip_body(msgspec.json.encode(_response()),
                                                   Injected(token_ids=True)))
    assert untouched["output"] == _response()["output"] and untouched["input_messages"] is None

    def event(data: dict, head: bytes = b"event: e\n") -> Event:
        """Spaced JSON, unlike the proxy's encoder: an event relayed as it came is seen."""
        raw = head + b"data: " + json.dumps(data).encode() + b"\n\n"
        return Event(raw=raw, data=raw[len(head) + 6:-2])

    delta = event({"type": "response.output_text.delta", "delta": "h",
                   "logprobs": [{"logprob": -1}]})
    assert api.strip_event(delta, Injected(logprobs=False)) == delta.raw
    out = api.strip_event(delta, Injected(logprobs=True))
    assert out.startswith(b"event: e\ndata: ") and out.endswith(b"\n\n")
    assert msgspec.json.decode(out[len(b"event: e\ndata: "):])["logprobs"] == []
    quoting = event({"type": "response.output_text.delta", "delta": "data: {}",
                     "logprobs": [{"logprob": -1}]})  # the text names the SSE field
    assert api.strip_event(quoting, Injected(logprobs=True)) == b"event: e\ndata: " + (
        msgspec.json.encode({"type": "response.output_text.delta", "delta": "data: {}",
                             "logprobs": []}) + b"\n\n")
    empty = event({"type": "response.output_text.delta", "delta": "h", "logprobs": []})
    assert api.strip_event(empty, Injected(logprobs=True)) == empty.raw  # byte for byte
    other = event({"type": "response.other", "logprobs": [1]})
    assert api.strip_event(other, Injected(logprobs=True)) == other.raw
    done = event({"type": "response.content_part.done", "part": {
        "type": "output_text", "logprobs": [{"logprob": -1}]}}, head=b"")
    out = api.strip_event(done, Injected(logprobs=True))
    assert out.startswith(b"data: ") and msgspec.json.decode(out[6:])["part"]["logprobs"] is None
    item = event({"type": "response.output_item.done", "item": {
        "type": "message", "content": [{"logprobs": [1]}]}})
    assert msgspec.json.decode(api.strip_event(item, Injected(logprobs=True)).split(
        b"data: ", 1)[1])["item"]["content"][0]["logprobs"] is None
    clean = event({"type": "response.output_item.done", "item": {"type": "message",
                                                                  "content": ["x"]}})
    assert api.strip_event(clean, Injected(logprobs=True)) == clean.raw
    final = event({"type": "response.completed", "response": _response()})
    out = msgspec.json.decode(api.strip_event(final, Injected(token_ids=True)).split(
        b"data: ", 1)[1])
    assert out["response"]["output_messages"] is None


def test_responses_capture_takes_the_final_response_as_the_authority():
    from tracetap.proxy.apis.responses.capture import ResponsesCapture

    capture = ResponsesCapture(keep_top=True)
    _feed(capture,
          {"type": "response.created", "response": {"id": "resp_9", "model": "m"}},
          {"type": "response.output_text.delta", "delta": "x", "logprobs": [{"logprob": -9}]},
          {"type": "response.function_call_arguments.delta", "item_id": "fc", "delta": "{"},
          {"type": "vendor.debug"}, {"type": "response.in_progress"}, {"no": "type"})
    assert (capture.response_id, capture.model, capture.unknown_events) == ("resp_9", "m", 2)
    assert not capture.ended and capture.tokens() == (None, None)
    _feed(capture, {"type": "response.completed", "response": _response()})
    assert capture.ended and capture.prompt_ids == [1, 2, 3, 4]
    assert capture.tokens() == (4, 2)
    [choice] = capture.choices()
    assert (choice.text, choice.completion_ids, choice.completion_logprobs) == (
        "hi", [7, 8], [-0.5, -0.25])
    assert choice.top_logprobs == [[{"t": 1}], []]
    assert (choice.index, choice.finish_reason, choice.token_source) == (0, "stop", "engine")
    assert (capture.logprobs_missing, capture.choice_count) == (0, 1)
    assert capture.reassembled(with_logprobs=True) is capture.final
    plain = capture.reassembled(with_logprobs=False)
    assert plain["output_messages"] is None and plain["output"][1]["logprobs"] is None
    assert capture.final["output_messages"] == [{"tokens": [7, 8]}]  # its own copy kept
    nothing = ResponsesCapture(keep_top=True)
    [empty] = nothing.choices()
    assert (empty.text, empty.completion_logprobs, empty.top_logprobs) == (None, None, None)
    assert nothing.logprobs_missing == 0  # no text, no ids: nothing is missing


@pytest.mark.parametrize(("fields", "finish"), [
    ({"status": "incomplete"}, "length"),
    ({"status": "completed", "output": [{"type": "function_call"}]}, "tool_calls"),
    ({"status": "failed"}, "failed"),
    ({"status": "completed"}, "stop"),
])
def test_responses_capture_names_the_finish_in_chats_words(fields, finish):
    from tracetap.proxy.apis.responses.capture import ResponsesCapture

    capture = ResponsesCapture()
    _feed(capture, _response(**fields))  # a whole, non-streamed reply
    assert capture.choices()[0].finish_reason == finish and not capture.ended
    assert (capture.response_id, capture.model) == ("resp_9", "m")
    assert capture.prompt_ids == [1, 2, 3, 4]


def test_responses_capture_without_a_final_response_keeps_the_deltas():
    from tracetap.proxy.apis.responses.capture import TERMINAL, ResponsesCapture

    assert TERMINAL == ("response.completed", "response.incomplete", "response.failed")
    capture = ResponsesCapture(keep_top=True)
    _feed(capture,
          {"type": "response.output_text.delta", "delta": "a", "logprobs": [
              {"logprob": -1.0, "top_logprobs": [1]}]},
          {"type": "response.output_text.delta", "logprobs": None},
          {"type": "response.output_text.delta", "delta": "b", "logprobs": [
              {"logprob": -2.0, "top_logprobs": [2]}]},
          b"[broken",
          *({"type": "error", "message": "overloaded"} for _ in range(6)))
    [choice] = capture.choices()
    assert (choice.text, choice.completion_ids, choice.completion_logprobs) == (
        "ab", None, [-1.0, -2.0])
    assert choice.top_logprobs == [[1], [2]] and choice.token_source == "none"
    assert choice.finish_reason is None and capture.logprobs_missing == 0
    assert capture.errors[1:] == ["upstream stream error: overloaded"] * 4
    capture.response_id, capture.model = "resp_x", "m"
    assert capture.reassembled(with_logprobs=True) == {
        "id": "resp_x", "object": "response", "model": "m", "status": "incomplete",
        "output": []}


@pytest.mark.parametrize(("messages", "ids"), [
    (None, None), ([], None), ("x", None), ([{"tokens": [1]}, {"tokens": None}], None),
    ([{"tokens": [1]}, "x"], None), ([{"tokens": []}, {"tokens": [5, 6]}], [5, 6])])
def test_responses_capture_reads_vllms_raw_tokens_only_when_each_entry_has_them(messages, ids):
    from tracetap.proxy.apis.responses.capture import ResponsesCapture

    capture = ResponsesCapture()
    _feed(capture, _response(input_messages=messages, output_messages=messages))
    assert capture.prompt_ids == ids
    assert capture.choices()[0].completion_ids == ids


@pytest.mark.parametrize(("logprobs", "values", "missing"), [
    ([{"logprob": -1}, {"logprob": -2}], [-1, -2], 0),
    ([{"logprob": -1}, {"token": "x"}], None, 1),  # an entry without its logprob
    ([{"logprob": -1}], None, 1),  # fewer than the ids
    ([], None, 1),
])
def test_responses_logprobs_are_kept_only_whole_and_one_per_id(logprobs, values, missing):
    from tracetap.proxy.apis.responses.capture import ResponsesCapture

    capture = ResponsesCapture()
    _feed(capture, _response(output=[{"type": "message", "content": [
        {"type": "output_text", "text": "ab", "logprobs": logprobs}]}]))
    [choice] = capture.choices()
    assert choice.completion_logprobs == values and capture.logprobs_missing == missing
    assert choice.top_logprobs is None  # the client did not ask for them


@pytest.mark.parametrize(("ids", "text"), [(None, "ab"), ([7, 8], "")],
                         ids=["text-without-ids", "ids-without-text"])
def test_responses_logprobs_are_missing_when_there_is_text_or_ids_without_them(ids, text):
    """Text from an engine that gives no ids (or ids of a reply with no text, a tool
    call's), and no logprobs: the call is counted as missing them."""
    from tracetap.proxy.apis.responses.capture import ResponsesCapture

    capture = ResponsesCapture()
    output_messages = None if ids is None else [{"tokens": ids}]
    _feed(capture, _response(output_messages=output_messages, output=[
        {"type": "message", "content": [{"type": "output_text", "text": text}]}]))
    [choice] = capture.choices()
    assert (choice.text, choice.completion_ids) == (text or None, ids)
    assert choice.completion_logprobs is None and capture.logprobs_missing == 1


def test_responses_capture_reads_an_output_text_part_without_text_as_empty():
    from tracetap.proxy.apis.responses.capture import ResponsesCapture

    capture = ResponsesCapture()
    _feed(capture, _response(output=[{"type": "message", "content": [
        {"type": "output_text", "text": "a"}, {"type": "output_text", "text": None},
        {"type": "output_text"}, {"type": "output_text", "text": "b"}]}]))
    assert capture.choices()[0].text == "ab"


def test_messages_capture_places_blocks_by_their_index_and_counts_every_unknown_event():
    """Blocks go where their index says, whatever order they start in (one without an
    index goes last); an empty text block adds no text; each unknown event is counted."""
    from tracetap.proxy.apis.messages.capture import MessagesCapture

    capture = MessagesCapture()
    _feed(capture,
          {"type": "content_block_start", "index": 1, "content_block": {"type": "text",
                                                                        "text": "second"}},
          {"type": "content_block_start", "index": 0, "content_block": {"type": "text",
                                                                        "text": "first "}},
          {"type": "content_block_start", "content_block": {"type": "text", "text": "!"}},
          {"type": "vendor_a"}, {"type": "vendor_b"}, {"type": "vendor_a"})
    [choice] = capture.choices()
    assert choice.text == "first second!" and capture.unknown_events == 3
    empty = MessagesCapture()
    _feed(empty, {"type": "message", "content": [{"type": "text", "text": ""},
                                                 {"type": "text"}]})
    assert empty.choices()[0].text is None
