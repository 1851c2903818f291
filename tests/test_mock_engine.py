"""The mock engine, driven by the real openai SDK: shapes, token ids, logprobs, faults."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tracetap.demo import tokenizer as tok
from tracetap.demo.engine import EngineConfig, EngineServer
from tracetap.demo.generate import Sampling, generate_chat

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look something up.",
            "parameters": {"type": "object", "properties": {"step": {"type": "integer"}}},
        },
    }
]
IDS = {"return_token_ids": True}


@contextlib.contextmanager
def running_engine(config: EngineConfig) -> Iterator[EngineServer]:
    """The engine on port 0, in a thread with its own event loop (the SDK client is sync)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="mock-engine", daemon=True)
    thread.start()
    server = EngineServer(config)
    try:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(timeout=10)
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(timeout=10)
        asyncio.run_coroutine_threadsafe(loop.shutdown_asyncgens(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@contextlib.contextmanager
def sdk_client(server: EngineServer) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=10)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineServer]:
    with running_engine(EngineConfig()) as server:
        yield server


@pytest.fixture(scope="module")
def client(engine: EngineServer) -> Iterator[openai.OpenAI]:
    with sdk_client(engine) as c:
        yield c


def raw_post(server: EngineServer, path: str, body: Any, method: str = "POST") -> tuple[int, bytes]:
    """Plain HTTP, for what the SDK hides: null fields, raw SSE lines, truncated bodies."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _extra(model: Any, name: str) -> Any:
    return (model.model_extra or {}).get(name)


def _reassemble_chat(chunks: list[Any]) -> dict[str, Any]:
    """Fold chat chunks of choice 0 back into what a non-streamed response holds."""
    out: dict[str, Any] = {"content": "", "token_ids": [], "logprobs": [], "tool_calls": {}}
    out["prompt_token_ids"] = _extra(chunks[0], "prompt_token_ids")
    for chunk in chunks:
        if not chunk.choices:
            out["usage"] = chunk.usage
            continue
        choice = chunk.choices[0]
        out["content"] += choice.delta.content or ""
        out["token_ids"] += _extra(choice, "token_ids") or []
        if choice.logprobs is not None:
            out["logprobs"] += [e.model_dump() for e in choice.logprobs.content]
        for call in choice.delta.tool_calls or ():
            slot = out["tool_calls"].setdefault(call.index, {"id": None, "name": "", "args": ""})
            slot["id"] = call.id or slot["id"]
            slot["name"] += call.function.name or ""
            slot["args"] += call.function.arguments or ""
        if choice.finish_reason is not None:
            out["finish_reason"] = choice.finish_reason
    return out


# ---- tokenizer and template -------------------------------------------------------------


def test_tokenizer_round_trips_text_and_special_tokens() -> None:
    text = "<|im_start|>user\nhé ☃<tool_call>{}</tool_call><|im_end|>\n"
    ids = tok.encode(text)
    assert ids[0] == tok.IM_START and tok.TOOL_CALL_START in ids and tok.TOOL_CALL_END in ids
    assert ids[-2:] == [tok.IM_END, ord("\n")]
    assert tok.decode(ids) == text
    assert max(ids) < tok.VOCAB_SIZE
    assert tok.token_str(0xE2) == "\ufffd"  # half of a UTF-8 character renders as U+FFFD
    assert tok.token_bytes(0xE2) == b"\xe2"
    assert tok.token_str(tok.IM_END) == "<|im_end|>"


def test_assistant_tool_call_renders_to_the_generated_text() -> None:
    arguments = tok.canonical_json({"step": 1, "a": [1, 2]})
    message = {
        "role": "assistant",
        "content": "Let me look.\n",
        "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "f", "arguments": arguments}}
        ],
    }
    expected = '<|im_start|>assistant\nLet me look.\n<tool_call>{"name":"f","arguments":'
    assert tok.render_message(message) == expected + arguments + "}</tool_call><|im_end|>\n"


# ---- chat -------------------------------------------------------------------------------


def test_chat_non_stream_returns_token_ids_and_aligned_logprobs(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    resp = client.chat.completions.create(
        model="mock-model", messages=messages, logprobs=True, top_logprobs=3, extra_body=IDS
    )
    choice = resp.choices[0]
    token_ids = _extra(choice, "token_ids")
    assert _extra(resp, "prompt_token_ids") == tok.apply_chat_template(messages)
    assert choice.finish_reason == "stop" and token_ids[-1] == tok.IM_END
    assert tok.decode(token_ids) == choice.message.content + "<|im_end|>"
    entries = choice.logprobs.content
    assert [e.token for e in entries] == [tok.token_str(t) for t in token_ids]
    assert all(e.logprob < 0 and len(e.top_logprobs) == 3 for e in entries)
    assert resp.usage.completion_tokens == len(token_ids)
    assert resp.usage.prompt_tokens == len(_extra(resp, "prompt_token_ids"))


def test_chat_without_capture_fields_keeps_them_null(engine: EngineServer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    status, data = raw_post(engine, "/v1/chat/completions", body)
    resp = json.loads(data)
    assert status == 200
    assert resp["prompt_token_ids"] is None and resp["choices"][0]["token_ids"] is None
    assert resp["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["text", "tool-call"])
def test_chat_stream_reassembles_to_the_non_stream_response(
    client: openai.OpenAI, tools: list | None
) -> None:
    kwargs: dict[str, Any] = {
        "model": "mock-model",
        "messages": [{"role": "user", "content": "Look it up."}],
        "logprobs": True,
        "top_logprobs": 2,
        "seed": 7,
        "extra_body": IDS,
    }
    if tools:
        kwargs["tools"] = tools
    whole = client.chat.completions.create(**kwargs)
    with client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    ) as stream:
        chunks = list(stream)
    got = _reassemble_chat(chunks)
    choice = whole.choices[0]
    assert got["prompt_token_ids"] == _extra(whole, "prompt_token_ids")
    assert got["token_ids"] == _extra(choice, "token_ids")
    assert got["logprobs"] == [e.model_dump() for e in choice.logprobs.content]
    assert got["finish_reason"] == choice.finish_reason
    assert got["usage"] == whole.usage
    assert got["content"] == (choice.message.content or "")
    calls = [
        {"id": c.id, "name": c.function.name, "args": c.function.arguments}
        for c in choice.message.tool_calls or ()
    ]
    assert list(got["tool_calls"].values()) == calls
    if tools:
        assert choice.finish_reason == "tool_calls" and calls[0]["name"] == "lookup"
    assert all(_extra(c, "usage") is None for c in chunks[:-1])  # vLLM omits it


def _turn(client: openai.OpenAI, messages: list, stream: bool) -> tuple[list, list, str, dict]:
    """One tool-enabled call: (prompt ids, completion ids, finish reason, assistant message)."""
    kwargs = {"model": "mock-model", "messages": messages, "tools": TOOLS, "extra_body": IDS}
    if not stream:
        resp = client.chat.completions.create(**kwargs)
        choice = resp.choices[0]
        message = choice.message.model_dump(exclude_none=True)
        ids = _extra(resp, "prompt_token_ids"), _extra(choice, "token_ids")
        return *ids, choice.finish_reason, message
    with client.chat.completions.create(stream=True, **kwargs) as events:
        got = _reassemble_chat(list(events))
    message = {"role": "assistant", "content": got["content"] or None}
    calls = [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
        for c in got["tool_calls"].values()
    ]
    message |= {"tool_calls": calls} if calls else {}
    return got["prompt_token_ids"], got["token_ids"], got["finish_reason"], message


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_tool_loop_prompts_extend_the_previous_prompt_and_completion(
    client: openai.OpenAI, stream: bool
) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Find the answer ☃."},
    ]
    previous: list[int] = []
    finishes = []
    for _ in range(4):
        prompt, completion, finish, message = _turn(client, messages, stream)
        assert prompt[: len(previous)] == previous
        previous = prompt + completion
        finishes.append(finish)
        messages.append(message)
        if finish == "tool_calls":
            call_id = message["tool_calls"][0]["id"]
            messages.append({"role": "tool", "tool_call_id": call_id, "content": "42"})
        else:
            messages.append({"role": "user", "content": "Thanks. Once more?"})
    assert finishes == ["tool_calls", "tool_calls", "stop", "stop"]


@pytest.mark.parametrize("seed", range(12))
def test_generated_tool_calls_render_back_exactly(seed: int) -> None:
    """With and without text before the call (the choice is seeded), for many seeds."""
    messages = [{"role": "user", "content": f"Task {seed}"}]
    prompt = tok.apply_chat_template(messages, TOOLS)
    sampling = Sampling(max_tokens=256, seed=seed)
    c = generate_chat(prompt, messages, TOOLS, None, 0, sampling, tool_rounds=1)
    assert c.finish_reason == "tool_calls" and c.token_ids[-1] == tok.IM_END
    message = {"role": "assistant", "content": c.content, "tool_calls": c.tool_calls}
    tool = {"role": "tool", "tool_call_id": c.tool_calls[0]["id"], "content": "ok"}
    following = tok.apply_chat_template([*messages, message, tool], TOOLS)
    assert following[: len(prompt) + len(c.token_ids)] == prompt + c.token_ids


def test_tool_preface_sets_the_share_of_tool_calls_with_text_before_them() -> None:
    """0: bare calls (a native Responses reply then has nowhere to put logprobs), 1: a
    sentence before every call, the default: some of each."""

    def prefaced(rate: float) -> list[bool]:
        out = []
        for seed in range(40):
            messages = [{"role": "user", "content": f"Task {seed}"}]
            prompt = tok.apply_chat_template(messages, TOOLS)
            c = generate_chat(prompt, messages, TOOLS, None, 0,
                              Sampling(max_tokens=256, seed=seed), tool_rounds=1, preface=rate)
            assert c.finish_reason == "tool_calls"
            out.append(c.content is not None)
        return out

    assert not any(prefaced(0.0)) and all(prefaced(1.0))
    assert 0 < sum(prefaced(0.5)) < 40
    with pytest.raises(ValueError, match="tool_preface"):
        EngineConfig(tool_preface=1.5)


def test_n_two_gives_two_different_choices(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="mock-model", messages=[{"role": "user", "content": "Hi"}], n=2, extra_body=IDS
    )
    assert [c.index for c in resp.choices] == [0, 1]
    first, second = (_extra(c, "token_ids") for c in resp.choices)
    assert first != second
    assert resp.usage.completion_tokens == len(first) + len(second)


def test_same_request_gives_the_same_completion(client: openai.OpenAI) -> None:
    def once() -> dict:
        resp = client.chat.completions.create(
            model="mock-model", messages=[{"role": "user", "content": "Hi"}], logprobs=True
        )
        return resp.model_dump(exclude={"id", "created"})

    assert once() == once()


def test_max_tokens_and_forced_length_set_finish_reason(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Talk."}]
    short = client.chat.completions.create(
        model="mock-model", messages=messages, max_tokens=3, extra_body=IDS
    )
    assert short.choices[0].finish_reason == "length"
    assert len(_extra(short.choices[0], "token_ids")) == 3
    forced = client.chat.completions.create(
        model="mock-model", messages=messages, extra_body=IDS | {"mock_completion_tokens": 50}
    )
    assert forced.choices[0].finish_reason == "stop"
    assert len(_extra(forced.choices[0], "token_ids")) == 50


def test_stop_string_cuts_the_text_but_keeps_its_tokens(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Talk."}]
    full = client.chat.completions.create(model="mock-model", messages=messages)
    text = full.choices[0].message.content
    stop = text[5:7]
    resp = client.chat.completions.create(
        model="mock-model", messages=messages, stop=[stop], extra_body=IDS
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and _extra(choice, "stop_reason") == stop
    assert choice.message.content == text[: text.index(stop)]
    assert tok.decode(_extra(choice, "token_ids")) == choice.message.content + stop


# ---- completions ------------------------------------------------------------------------


def test_completions_stream_reassembles_to_the_non_stream_response(
    client: openai.OpenAI,
) -> None:
    kwargs: dict[str, Any] = {
        "model": "mock-model",
        "prompt": tok.encode("Once upon a time"),
        "logprobs": 2,
        "max_tokens": 40,
        "extra_body": IDS,
    }
    whole = client.completions.create(**kwargs).choices[0]
    assert _extra(whole, "prompt_token_ids") == kwargs["prompt"]
    token_ids = _extra(whole, "token_ids")
    assert len(whole.logprobs.tokens) == len(token_ids) == len(whole.logprobs.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in whole.logprobs.top_logprobs)
    with client.completions.create(stream=True, **kwargs) as stream:
        chunks = [c.choices[0] for c in stream]
    assert _extra(chunks[0], "prompt_token_ids") == kwargs["prompt"]
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in _extra(c, "token_ids")] == token_ids
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        streamed = [x for c in chunks for x in getattr(c.logprobs, field)]
        assert streamed == getattr(whole.logprobs, field)
    assert chunks[-1].finish_reason == whole.finish_reason


def test_completions_logprobs_zero_gives_only_the_sampled_token(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="mock-model", prompt="Hello", logprobs=0)
    lp = resp.choices[0].logprobs
    assert [list(top) for top in lp.top_logprobs] == [[t] for t in lp.tokens]


def test_completions_batch_and_n(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model="mock-model", prompt=["alpha", "beta"], n=2, max_tokens=8, extra_body=IDS
    )
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    prompts = [_extra(c, "prompt_token_ids") for c in resp.choices]
    assert prompts == [tok.encode("alpha")] * 2 + [tok.encode("beta")] * 2
    assert len({c.text for c in resp.choices}) == 4
    assert resp.usage.prompt_tokens == len("alpha") + len("beta")


# ---- flavors ----------------------------------------------------------------------------


def test_openai_flavor_rejects_return_token_ids() -> None:
    with running_engine(EngineConfig(flavor="openai")) as server, sdk_client(server) as client:
        messages = [{"role": "user", "content": "Hi"}]
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="m", messages=messages, extra_body=IDS)
        error = info.value.body
        assert error["type"] == "invalid_request_error" and "return_token_ids" in error["message"]
        with client.chat.completions.create(
            model="m", messages=messages, stream=True, stream_options={"include_usage": True}
        ) as stream:
            chunks = list(stream)
        assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage is not None
        assert _extra(chunks[0], "prompt_token_ids") is None
        assert raw_post(server, "/version", None, method="GET")[0] == 404


def test_llamacpp_flavor_puts_token_ids_in_logprob_entries() -> None:
    with running_engine(EngineConfig(flavor="llamacpp")) as server, sdk_client(server) as client:
        resp = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], logprobs=True, extra_body=IDS
        )
        entries = resp.choices[0].logprobs.content
        assert _extra(resp, "prompt_token_ids") is None
        assert [tok.token_str(_extra(e, "id")) for e in entries] == [e.token for e in entries]
        assert _extra(entries[-1], "id") == tok.IM_END


# ---- other endpoints and fault injection --------------------------------------------------


def test_models_version_health_and_tokenize(engine: EngineServer) -> None:
    status, data = raw_post(engine, "/v1/models", None, method="GET")
    card = json.loads(data)["data"][0]
    assert status == 200 and card["id"] == "mock-model" and card["owned_by"] == "vllm"
    assert json.loads(raw_post(engine, "/version", None, "GET")[1]) == {"version": "0.11.0"}
    assert raw_post(engine, "/health", None, "GET")[0] == 200
    messages = [{"role": "user", "content": "hi"}]
    tokens = json.loads(raw_post(engine, "/tokenize", {"messages": messages})[1])
    assert tokens["tokens"] == tok.apply_chat_template(messages)
    assert tokens["count"] == len(tokens["tokens"])


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", b'{"model": "m"}'),
        ("/v1/chat/completions", b'{"messages": "hi"}'),
        ("/v1/completions", b'{"model": "m"}'),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}'),
        ("/v1/completions", b'{"prompt": [1, 99999]}'),
    ],
)
def test_bad_requests_get_openai_style_errors(engine: EngineServer, path: str, body: bytes) -> None:
    status, data = raw_post(engine, path, body)
    assert status == 400
    error = json.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_injected_status_and_delay(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(
            model="m", messages=messages, extra_body={"mock_status": 503, "mock_delay_s": 0.05}
        )
    assert info.value.status_code == 503
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="m", prompt="x", extra_body={"mock_status": 429})


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Hi"}]} | extra


def test_stream_aborted_after_n_chunks_is_truncated(engine: EngineServer) -> None:
    conn = http.client.HTTPConnection(engine.host, engine.port, timeout=10)
    try:
        body = json.dumps(chat_body(stream=True, mock_fail_after_chunks=3)).encode()
        conn.request("POST", "/v1/chat/completions", body=body)
        resp = conn.getresponse()
        assert resp.status == 200
        with pytest.raises(http.client.IncompleteRead) as info:
            resp.read()
    finally:
        conn.close()
    events = info.value.partial.split(b"\n\n")
    assert [e[:6] for e in events if e] == [b"data: "] * 3


def test_non_stream_body_is_truncated(engine: EngineServer) -> None:
    with pytest.raises(http.client.IncompleteRead):
        raw_post(engine, "/v1/chat/completions", chat_body(mock_fail_after_chunks=0))


def test_garbage_in_stream(engine: EngineServer) -> None:
    status, data = raw_post(engine, "/v1/chat/completions",
                            chat_body(stream=True, mock_garbage=True))
    events = [e for e in data.split(b"\n\n") if e]
    assert status == 200 and events[-1] == b"data: [DONE]"
    assert b"data: {this is not json" in events


# ---- tool arguments follow the tool's schema ----------------------------------------------

SCHEMA_TOOL = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "required": ["city", "nights", "rate", "pets", "tags", "room", "guest"],
    "properties": {
        "city": {"type": "string"},
        "nights": {"type": "integer", "minimum": 2, "maximum": 5},
        "rate": {"type": "number"},
        "pets": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "room": {"enum": ["single", "double"]},
        "guest": {"type": "object", "required": ["name"],
                  "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}},
        "note": {"type": ["string", "null"]},
    }}}}


def _valid(value: Any) -> bool:
    return (isinstance(value["city"], str) and type(value["nights"]) is int
            and 2 <= value["nights"] <= 5 and isinstance(value["rate"], float)
            and type(value["pets"]) is bool and value["tags"]
            and all(isinstance(t, str) for t in value["tags"])
            and value["room"] in ("single", "double") and isinstance(value["guest"]["name"], str)
            and set(value) <= {*SCHEMA_TOOL["function"]["parameters"]["properties"]}
            and type(value["guest"].get("age", 0)) is int
            and isinstance(value.get("note", ""), str))


@pytest.mark.parametrize("seed", range(8))
def test_tool_arguments_have_every_required_field_with_its_type(seed: int) -> None:
    messages = [{"role": "user", "content": "Book it."}]
    prompt = tok.apply_chat_template(messages, [SCHEMA_TOOL])
    calls = [generate_chat(prompt, messages, [SCHEMA_TOOL], None, 0, Sampling(400, seed), 1)
             for _ in range(2)]
    arguments = [c.tool_calls[0]["function"]["arguments"] for c in calls]
    assert arguments[0] == arguments[1]  # deterministic per seed
    assert arguments[0] == tok.canonical_json(json.loads(arguments[0]))  # compact, sorted
    assert _valid(json.loads(arguments[0]))


def test_tool_arguments_differ_across_seeds_and_follow_the_chosen_tool() -> None:
    messages = [{"role": "user", "content": "Book it."}]
    tools = [*TOOLS, SCHEMA_TOOL]
    prompt = tok.apply_chat_template(messages, tools)
    choice = {"type": "function", "function": {"name": "book"}}
    seen = {generate_chat(prompt, messages, tools, choice, 0, Sampling(400, seed), 1)
            .tool_calls[0]["function"]["arguments"] for seed in range(6)}
    assert len(seen) > 1 and all(_valid(json.loads(a)) for a in seen)


# ---- llama.cpp flavors -------------------------------------------------------------------


def test_llama_server_flavor_serves_its_tokenizer_endpoints() -> None:
    with running_engine(EngineConfig(flavor="llama-server")) as server:
        messages = [{"role": "user", "content": "é?"}]
        status, data = raw_post(server, "/apply-template", {"messages": messages})
        assert status == 200 and json.loads(data) == {"prompt": tok.render_chat(messages)}
        text = "<|im_end|>é"
        assert json.loads(raw_post(server, "/tokenize", {"content": text})[1]) == {
            "tokens": tok.encode(text)}
        literal = json.loads(raw_post(server, "/tokenize", {"content": text,
                                                            "parse_special": False})[1])
        assert literal["tokens"] == list(text.encode())
        pieces = json.loads(raw_post(server, "/tokenize", {"content": text,
                                                           "with_pieces": True})[1])["tokens"]
        assert pieces == [{"id": tok.IM_END, "piece": "<|im_end|>"},
                          {"id": 0xC3, "piece": [0xC3]}, {"id": 0xA9, "piece": [0xA9]}]
        assert json.loads(raw_post(server, "/detokenize", {"tokens": tok.encode(text)})[1]) == {
            "content": text}
        card = json.loads(raw_post(server, "/v1/models", None, "GET")[1])["data"][0]
        assert card["owned_by"] == "llamacpp"
        assert raw_post(server, "/extras/tokenize", {"input": "x"})[0] == 404


def test_llama_cpp_python_flavor_gives_token_strings_but_no_ids() -> None:
    with running_engine(EngineConfig(flavor="llama-cpp-python")) as server, \
            sdk_client(server) as client:
        messages = [{"role": "user", "content": "Hi"}]
        plain = client.chat.completions.create(model="m", messages=messages, logprobs=True)
        assert plain.choices[0].logprobs is None  # logprobs only with top_logprobs
        resp = client.chat.completions.create(model="m", messages=messages, logprobs=True,
                                              top_logprobs=0, extra_body=IDS)
        choice = resp.choices[0]
        entries = choice.logprobs.content
        assert _extra(resp, "prompt_token_ids") is None and _extra(choice, "token_ids") is None
        assert all(e.bytes is None and _extra(e, "id") is None for e in entries)
        # It stops before the end-of-turn token: neither logprobs nor usage count it.
        assert "".join(e.token for e in entries) == choice.message.content
        assert resp.usage.completion_tokens == len(entries) == len(tok.encode(
            choice.message.content))
        with client.chat.completions.create(model="m", messages=messages, logprobs=True,
                                            top_logprobs=0, stream=True,
                                            stream_options={"include_usage": True}) as stream:
            chunks = list(stream)
        assert all(c.usage is None for c in chunks)  # no usage in its streams
        streamed = [e.token for c in chunks for e in (c.choices[0].logprobs.content
                                                     if c.choices[0].logprobs else ())]
        assert streamed == [e.token for e in entries]
        card = json.loads(raw_post(server, "/v1/models", None, "GET")[1])["data"][0]
        assert card["owned_by"] == "me"


def test_llama_cpp_python_flavor_serves_extras_and_shows_split_bytes_as_nothing() -> None:
    with running_engine(EngineConfig(flavor="llama-cpp-python")) as server, \
            sdk_client(server) as client:
        text = "Café <|im_end|>"
        assert json.loads(raw_post(server, "/extras/tokenize", {"input": text})[1]) == {
            "tokens": tok.encode(text)}
        assert json.loads(raw_post(server, "/extras/tokenize/count", {"input": text})[1]) == {
            "count": len(tok.encode(text))}
        # Special tokens render as nothing; a lone UTF-8 byte is the server's own error.
        assert json.loads(raw_post(server, "/extras/detokenize",
                                   {"tokens": tok.encode(text)})[1]) == {"text": "Café "}
        assert raw_post(server, "/extras/detokenize", {"tokens": [0xC3]})[0] == 500
        for path in ("/tokenize", "/apply-template", "/detokenize", "/v1/responses"):
            assert raw_post(server, path, {})[0] == 404
        resp = client.completions.create(model="m", prompt="Say", logprobs=0,
                                         extra_body={"mock_content": "é!"})
        assert resp.choices[0].text == "é!"
        assert resp.choices[0].logprobs.tokens == ["", "", "!"]


def test_llama_cpp_python_flavor_ends_a_stream_when_another_request_arrives() -> None:
    """Like the real server's --interrupt_requests (on by default)."""
    with running_engine(EngineConfig(flavor="llama-cpp-python")) as server:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
        body = {"prompt": "Say", "stream": True, "mock_content": "x" * 40,
                "mock_chunk_delay_s": 0.05}
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        first = resp.readline()  # the first chunk is out: the generation is under way
        assert first.startswith(b"data: {")
        assert raw_post(server, "/extras/tokenize", {"input": "hi"})[0] == 200
        rest = resp.read()
        conn.close()
        texts = [json.loads(line[6:])["choices"][0]["text"]
                 for line in [first, *rest.split(b"\n")]
                 if line.startswith(b"data: {")]
        assert rest.rstrip().endswith(b"data: [DONE]")
        assert len("".join(texts)) < 40  # cut short, well before its 40 characters
