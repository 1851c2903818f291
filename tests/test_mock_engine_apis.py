"""The mock engine's Responses and Messages APIs, driven by the official openai and anthropic
SDKs: each answer must parse, and carry the same text, token ids and logprobs as the chat
completion of the same conversation (the mock renders both through one chat template)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tracetap.demo import tokenizer as tok
from tracetap.demo.engine import EngineConfig, EngineServer

SCHEMA = {"type": "object", "properties": {"step": {"type": "integer"}}}
RESPONSES_TOOL = {
    "type": "function",
    "name": "lookup",
    "description": "Look something up.",
    "parameters": SCHEMA,
}
MESSAGES_TOOL = {"name": "lookup", "description": "Look something up.", "input_schema": SCHEMA}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "lookup", "description": "Look something up.", "parameters": SCHEMA},
}
LOGPROBS = {"top_logprobs": 2, "include": ["message.output_text.logprobs"]}
IDS = {"enable_response_messages": True}


@pytest.fixture
def oai(engine: EngineServer) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=engine.url, api_key="unused", max_retries=0, timeout=10)
    yield client
    client.close()


@pytest.fixture
def claude(engine: EngineServer) -> Iterator[anthropic.Anthropic]:
    client = anthropic.Anthropic(
        base_url=engine.base_url, api_key="unused", max_retries=0, timeout=10
    )
    yield client
    client.close()


def _extra(model: Any, name: str) -> Any:
    return (model.model_extra or {}).get(name)


def chat(client: openai.OpenAI, messages: list, tools: list | None = None, **extra: Any) -> dict:
    """The reference: the chat completion of a conversation, with ids and logprobs."""
    resp = client.chat.completions.create(
        model="mock-model",
        messages=messages,
        tools=tools or openai.omit,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True} | extra,
    )
    choice = resp.choices[0]
    return {
        "prompt": _extra(resp, "prompt_token_ids"),
        "ids": _extra(choice, "token_ids"),
        "content": choice.message.content,
        "calls": choice.message.tool_calls or [],
        "logprobs": [e.model_dump() for e in choice.logprobs.content],
        "finish": choice.finish_reason,
    }


def raw(server: EngineServer, path: str, body: Any) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def sse_events(data: bytes) -> list[tuple[str, dict]]:
    """(event name, payload) of each named event; every one must name its payload's type."""
    events = []
    for block in data.decode().split("\n\n"):
        if block:
            head, body = block.split("\n")
            assert head.startswith("event: ") and body.startswith("data: ")
            events.append((head[7:], json.loads(body[6:])))
            assert events[-1][0] == events[-1][1]["type"]
    return events


def _without_ids(response: Any) -> dict:
    """The body minus ids, time, and what ``responses.stream`` adds (``parsed*`` fields)."""
    body = response.model_dump(exclude={"id", "created_at"})
    for item in body["output"]:
        item.pop("id")
        item.pop("parsed_arguments", None)
        for part in item.get("content", ()):
            part.pop("parsed", None)
    return body


# ---- Responses ------------------------------------------------------------------------


def test_responses_text_equals_the_chat_completion(oai: openai.OpenAI) -> None:
    resp = oai.responses.create(
        model="mock-model",
        instructions="You are terse.",
        input="Say something ☃.",
        extra_body=IDS,
        **LOGPROBS,
    )
    system = {"role": "system", "content": "You are terse."}
    ref = chat(oai, [system, {"role": "user", "content": "Say something ☃."}])
    assert resp.status == "completed" and resp.output_text == ref["content"]
    (message,) = resp.output
    assert [e.model_dump() for e in message.content[0].logprobs] == ref["logprobs"]
    (prompt,), (output,) = _extra(resp, "input_messages"), _extra(resp, "output_messages")
    assert prompt["tokens"] == ref["prompt"] and output["tokens"] == ref["ids"]
    assert prompt["type"] == output["type"] == "raw_message_tokens"
    assert tok.decode(prompt["tokens"]) == prompt["message"]
    assert resp.usage.input_tokens == len(ref["prompt"])
    assert resp.usage.output_tokens == len(ref["ids"])


def test_responses_logprobs_and_ids_only_when_asked(oai: openai.OpenAI) -> None:
    plain = oai.responses.create(model="m", input="Hi", top_logprobs=3)
    assert plain.output[0].content[0].logprobs is None
    assert _extra(plain, "input_messages") is None and _extra(plain, "output_messages") is None
    bare = oai.responses.create(model="m", input="Hi", include=LOGPROBS["include"])
    entries = bare.output[0].content[0].logprobs
    assert entries and all(e.top_logprobs == [] for e in entries)
    assert [e.token for e in entries][-1] == "<|im_end|>"  # every completion token, like chat


def test_responses_input_items_render_as_the_chat_conversation(oai: openai.OpenAI) -> None:
    items = [
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "Rules: "}, {"type": "input_text", "text": "none."}
        ]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "user", "content": "First?"},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "One.", "annotations": []}
        ]},
        {"role": "user", "content": [{"type": "input_text", "text": "Second?"}]},
    ]
    resp = oai.responses.create(model="m", input=items, extra_body=IDS)
    ref = chat(oai, [
        {"role": "developer", "content": "Rules: none."},
        {"role": "user", "content": "First?"},
        {"role": "assistant", "content": "One."},
        {"role": "user", "content": "Second?"},
    ])
    assert _extra(resp, "input_messages")[0]["tokens"] == ref["prompt"]
    assert resp.output_text == ref["content"]


@pytest.mark.parametrize("tools", [None, [RESPONSES_TOOL]], ids=["text", "tool-call"])
def test_responses_stream_reassembles_to_the_non_stream_response(
    oai: openai.OpenAI, tools: list | None
) -> None:
    kwargs: dict[str, Any] = {"model": "mock-model", "input": "Look it up.", "extra_body": IDS}
    kwargs |= LOGPROBS | ({"tools": tools} if tools else {})
    whole = oai.responses.create(**kwargs)
    with oai.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert _without_ids(final) == _without_ids(whole)
    with oai.responses.create(stream=True, **kwargs) as raw_events:
        plain = list(raw_events)
    assert [e.type for e in plain] == [e.type for e in events]
    assert _without_ids(plain[-1].response) == _without_ids(whole)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed"
    assert _extra(events[0].response, "input_messages") is None  # ids come only at the end
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    args = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert done.logprobs == []  # as in vLLM: the full list comes in the later events
    if not tools:
        full = whole.output[0].content[0].logprobs
        assert "".join(d.delta for d in deltas) == done.text == whole.output_text
        streamed = [lp.model_dump() for d in deltas for lp in d.logprobs]
        without_bytes = [
            {"token": e.token, "logprob": e.logprob, "top_logprobs": [
                {"token": t.token, "logprob": t.logprob} for t in e.top_logprobs
            ]} for e in full
        ]
        assert streamed == without_bytes[: len(streamed)] and len(streamed) == len(full) - 1
    else:
        call = whole.output[-1]
        assert call.type == "function_call" and "".join(args) == call.arguments


TEXT_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",  # one or more
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
CALL_EVENTS = [
    "response.output_item.added",
    "response.function_call_arguments.delta",  # one or more
    "response.function_call_arguments.done",
    "response.output_item.done",
]


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("Hi", TEXT_EVENTS + CALL_EVENTS), ("Find it.", CALL_EVENTS)],
    ids=["text-then-call", "call-only"],
)
def test_responses_stream_wire_is_named_events_without_done(
    engine: EngineServer, prompt: str, expected: list[str]
) -> None:
    body = {"model": "m", "input": prompt, "stream": True, "tools": [RESPONSES_TOOL]}
    status, data = raw(engine, "/v1/responses", body)
    names = [name for name, _ in sse_events(data)]
    runs = [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]
    assert status == 200 and b"[DONE]" not in data
    assert runs == ["response.created", "response.in_progress", *expected, "response.completed"]


def _next_turn(resp: Any) -> tuple[list[dict], list[dict]]:
    """What the harness resends (the output items, a result per call), and the same turn as
    chat messages for the reference conversation."""
    items = [item.model_dump(exclude_none=True) for item in resp.output]
    calls = [i for i in resp.output if i.type == "function_call"]
    text = "".join(i.content[0].text for i in resp.output if i.type == "message") or None
    assistant: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        assistant["tool_calls"] = [
            {"id": c.call_id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": "42"}
               for c in calls] or [{"role": "user", "content": "Thanks. Once more?"}]
    chat_results = [{"role": "tool", "tool_call_id": c.call_id, "content": "42"}
                    for c in calls] or [{"role": "user", "content": "Thanks. Once more?"}]
    return items + results, [assistant, *chat_results]


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_responses_tool_loop_matches_the_chat_path_turn_by_turn(
    oai: openai.OpenAI, stream: bool
) -> None:
    # A question whose deterministic replies include both a call after text and a call alone.
    items: list[dict] = [{"role": "user", "content": "Look up the answer ☃."}]
    messages: list[dict] = [{"role": "user", "content": "Look up the answer ☃."}]
    previous: list[int] = []
    kinds = []
    for _ in range(4):
        kwargs = {"model": "mock-model", "input": items, "tools": [RESPONSES_TOOL]}
        kwargs |= LOGPROBS | {"extra_body": IDS | {"seed": 0}}
        if stream:
            with oai.responses.stream(**kwargs) as events:
                resp = events.get_final_response()
        else:
            resp = oai.responses.create(**kwargs)
        ref = chat(oai, messages, [CHAT_TOOL], seed=0)
        prompt = _extra(resp, "input_messages")[0]["tokens"]
        output = _extra(resp, "output_messages")[0]["tokens"]
        assert prompt == ref["prompt"] and output == ref["ids"]
        assert prompt[: len(previous)] == previous  # the turns merge into one trajectory
        previous = prompt + output
        kinds.append([item.type for item in resp.output])
        new_items, new_messages = _next_turn(resp)
        items += new_items
        messages += new_messages
    # text before a call comes back as a message item that must merge with the call again
    assert kinds == [["message", "function_call"], ["function_call"], ["message"], ["message"]]


def test_responses_bad_requests_get_openai_errors(oai: openai.OpenAI) -> None:
    for kwargs in (
        {"input": []},
        {"input": [{"type": "web_search_call", "id": "ws_1"}]},
        {"input": [{"type": "function_call", "call_id": "c1", "name": "f"}]},
        {"input": "Hi", "previous_response_id": "resp_1"},
        {"input": "Hi", "top_logprobs": 99, "include": LOGPROBS["include"]},
    ):
        with pytest.raises(openai.BadRequestError) as info:
            oai.responses.create(model="m", **kwargs)
        assert set(info.value.body) == {"message", "type", "param", "code"}
    with pytest.raises(openai.InternalServerError) as failed:
        oai.responses.create(model="m", input="Hi", extra_body={"mock_status": 503})
    assert failed.value.status_code == 503


@pytest.mark.parametrize(
    ("path", "body", "first"),
    [
        ("/v1/responses", {"model": "m", "input": "Hi"},
         ["response.created", "response.in_progress", "response.output_item.added"]),
        ("/v1/messages", {"model": "m", "max_tokens": 50, "messages": [
            {"role": "user", "content": "Hi"}
        ]}, ["message_start", "content_block_start", "content_block_delta"]),
    ],
    ids=["responses", "messages"],
)
def test_stream_faults_cut_or_garble_named_events(
    engine: EngineServer, path: str, body: dict, first: list[str]
) -> None:
    body = body | {"stream": True}
    conn = http.client.HTTPConnection(engine.host, engine.port, timeout=10)
    try:
        conn.request("POST", path, body=json.dumps(body | {"mock_fail_after_chunks": 3}))
        with pytest.raises(http.client.IncompleteRead) as info:
            conn.getresponse().read()
    finally:
        conn.close()
    assert [name for name, _ in sse_events(info.value.partial)] == first
    status, data = raw(engine, path, body | {"mock_garbage": True})
    assert status == 200
    assert f"event: {first[2]}\ndata: {{this is not json\n\n".encode() in data


def test_responses_max_output_tokens_makes_it_incomplete(oai: openai.OpenAI) -> None:
    resp = oai.responses.create(model="m", input="Talk.", max_output_tokens=3, extra_body=IDS)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3 == len(_extra(resp, "output_messages")[0]["tokens"])
    assert resp.max_output_tokens == 3


# ---- Messages -------------------------------------------------------------------------


def test_messages_text_equals_the_chat_completion(
    claude: anthropic.Anthropic, oai: openai.OpenAI, engine: EngineServer
) -> None:
    system = [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}]
    turns = [{"role": "user", "content": [{"type": "text", "text": "Say something ☃."}]}]
    msg = claude.messages.create(model="mock-model", max_tokens=300, system=system,
                                 messages=turns)
    system_message = {"role": "system", "content": "You are terse."}
    ref = chat(oai, [system_message, {"role": "user", "content": "Say something ☃."}])
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == ref["content"]
    assert msg.stop_reason == "end_turn" and msg.id.startswith("chatcmpl-")
    assert msg.usage.input_tokens == len(ref["prompt"])
    assert msg.usage.output_tokens == len(ref["ids"])
    count = claude.messages.count_tokens(model="mock-model", system=system, messages=turns)
    assert count.input_tokens == len(ref["prompt"])
    body = {"model": "m", "max_tokens": 300, "messages": turns, "top_logprobs": 2}
    _, data = raw(engine, "/v1/messages", body | {"return_token_ids": True})
    assert set(json.loads(data)) == {"id", "type", "role", "content", "model", "stop_reason",
                                     "usage"}  # no ids, no logprobs, no null stop_sequence


@pytest.mark.parametrize("tools", [None, [MESSAGES_TOOL]], ids=["text", "tool-use"])
def test_messages_stream_reassembles_to_the_non_stream_message(
    claude: anthropic.Anthropic, engine: EngineServer, tools: list | None
) -> None:
    kwargs: dict[str, Any] = {"model": "mock-model", "max_tokens": 300}
    kwargs["messages"] = [{"role": "user", "content": "Look it up."}]
    kwargs |= {"tools": tools} if tools else {}
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})
    assert text == "".join(b.text for b in whole.content if b.type == "text")
    status, data = raw(engine, "/v1/messages?beta=true", kwargs | {"stream": True})
    names = [name for name, _ in sse_events(data)]
    assert status == 200 and b"[DONE]" not in data
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_start") == names.count("content_block_stop")
    assert names.count("content_block_start") == len(whole.content)
    if tools:  # the arguments follow the tool's schema: "step" is optional, an integer
        use = whole.content[-1]
        assert whole.stop_reason == "tool_use" and set(use.input) <= {"step"}
        assert all(type(v) is int for v in use.input.values())


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_messages_tool_use_loop_matches_the_chat_path_turn_by_turn(
    claude: anthropic.Anthropic, oai: openai.OpenAI, stream: bool
) -> None:
    # A question whose deterministic replies include both a call after text and a call alone.
    turns: list[dict] = [{"role": "user", "content": "Look up the answer ☃."}]
    messages: list[dict] = [{"role": "system", "content": "Be brief."}, *turns]
    previous: list[int] = []
    stops = []
    for _ in range(4):
        kwargs = {"model": "mock-model", "max_tokens": 400, "system": "Be brief."}
        kwargs |= {"messages": turns, "tools": [MESSAGES_TOOL]}
        if stream:
            with claude.messages.stream(**kwargs) as events:
                msg = events.get_final_message()
        else:
            msg = claude.messages.create(**kwargs)
        ref = chat(oai, messages, [CHAT_TOOL])
        assert ref["prompt"][: len(previous)] == previous
        previous = ref["prompt"] + ref["ids"]
        assert msg.usage.input_tokens == len(ref["prompt"])
        assert msg.usage.output_tokens == len(ref["ids"])
        texts = [b.text for b in msg.content if b.type == "text"]
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert "".join(texts) == (ref["content"] or "")
        assert [(u.id, u.name, u.input) for u in uses] == [
            (c.id, c.function.name, json.loads(c.function.arguments)) for c in ref["calls"]
        ]
        stops.append((msg.stop_reason, [b.type for b in msg.content]))
        turns.append({"role": "assistant", "content": [b.model_dump() for b in msg.content]})
        assistant = {"role": "assistant", "content": ref["content"]}
        messages.append(assistant | ({"tool_calls": [
            c.model_dump() for c in ref["calls"]
        ]} if uses else {}))
        if uses:
            turns.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": "42"} for u in uses
            ]})
            messages += [{"role": "tool", "tool_call_id": u.id, "content": "42"} for u in uses]
        else:
            turns.append({"role": "user", "content": "Thanks. Once more?"})
            messages.append({"role": "user", "content": "Thanks. Once more?"})
    assert stops == [
        ("tool_use", ["text", "tool_use"]),  # text before a call, then a call alone
        ("tool_use", ["tool_use"]),
        ("end_turn", ["text"]),
        ("end_turn", ["text"]),
    ]


def test_messages_beta_path_and_stop_sequences(
    claude: anthropic.Anthropic, oai: openai.OpenAI
) -> None:
    turns = [{"role": "user", "content": "Talk."}]
    full = chat(oai, turns)["content"]
    stop = full[5:7]
    msg = claude.beta.messages.create(
        model="mock-model", max_tokens=300, messages=turns, stop_sequences=[stop]
    )
    assert msg.content[0].text == full[: full.index(stop)] == chat(oai, turns, stop=[stop])[
        "content"
    ]
    assert msg.stop_reason == "end_turn"  # as vLLM reports it, with no stop_sequence
    short = claude.messages.create(model="mock-model", max_tokens=3, messages=turns)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_messages_errors_use_the_anthropic_shape(
    claude: anthropic.Anthropic, engine: EngineServer
) -> None:
    turns = [{"role": "user", "content": "Hi"}]
    for body in (
        {"model": "m", "messages": turns},
        {"model": "m", "max_tokens": 10, "messages": turns, "tools": [{"name": "x"}]},
        {"model": "m", "max_tokens": 10, "messages": [{"role": "tool", "content": "x"}]},
        b"{not json",
    ):
        status, data = raw(engine, "/v1/messages", body)
        error = json.loads(data)
        assert status == 400 and error["type"] == "error"
        assert error["error"]["type"] == "invalid_request_error" and error["error"]["message"]
    with pytest.raises(anthropic.RateLimitError) as limited:
        claude.messages.create(model="m", max_tokens=10, messages=turns,
                               extra_body={"mock_status": 429})
    assert limited.value.body["error"]["type"] == "rate_limit_error"
    with pytest.raises(anthropic.APIStatusError) as overloaded:
        claude.messages.create(model="m", max_tokens=10, messages=turns,
                               extra_body={"mock_status": 529})
    assert overloaded.value.status_code == 529
    assert overloaded.value.body["error"]["type"] == "overloaded_error"


# ---- flavors --------------------------------------------------------------------------


@pytest.mark.parametrize("engine_config", [EngineConfig(flavor="openai")], ids=["openai"])
def test_openai_flavor_serves_responses_but_not_messages(
    oai: openai.OpenAI, engine: EngineServer
) -> None:
    assert oai.responses.create(model="m", input="Hi", **LOGPROBS).output_text
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model="m", input="Hi", extra_body=IDS)
    assert "enable_response_messages" in info.value.body["message"]
    assert raw(engine, "/v1/messages", {"model": "m", "max_tokens": 5, "messages": []})[0] == 404


@pytest.mark.parametrize("engine_config", [EngineConfig(flavor="llamacpp")], ids=["llamacpp"])
def test_llamacpp_flavor_is_chat_only(
    oai: openai.OpenAI, claude: anthropic.Anthropic, engine: EngineServer
) -> None:
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="m", input="Hi")
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert chat(oai, [{"role": "user", "content": "Hi"}])["content"]
