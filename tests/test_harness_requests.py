"""Requests as the shipped CLIs send them, through translation to chat completions.

tests/fixtures/harness_requests holds request bodies captured from the real CLIs (Claude
Code, Codex, Qwen Code, opencode; docs/harnesses.md says how). Each is replayed through
``to_chat``: the chat request must carry the same conversation (every text, in order;
every tool call with its id, name and arguments; every tool result; every function tool),
the engine must accept it, and what was dropped must be exactly what the table below
says, so a CLI release that starts sending something new shows up here as a diff.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import anthropic
import openai
import pytest
from helpers.http import fetch, metrics_text, post

from tracetap.proxy.apis.dropped import Dropped
from tracetap.proxy.apis.messages.request import to_chat as messages_to_chat
from tracetap.proxy.apis.responses.request import to_chat as responses_to_chat

FIXTURES = Path(__file__).parent / "fixtures" / "harness_requests"
TRANSLATED = sorted(p.name for p in FIXTURES.glob("*.json")
                    if json.loads(p.read_text())["api"] != "chat")
TO_CHAT = {"messages": messages_to_chat, "responses": responses_to_chat}
_CLAUDE = {"cache_control": 3, "context_management": 1, "deferred_tool": 1, "effort": 1,
           "metadata": 1, "thinking": 1}
_CODEX = {"hosted_tool": 2, "include": 1, "metadata": 1, "prompt_cache_key": 1,
          "reasoning_summary": 1, "store": 1}
DROPPED = {
    "claude-code-2.1.197-first.json": {"cache_control": 3, "context_management": 1,
                                       "metadata": 1},
    "claude-code-2.1.197-subagent-tool-turns.json": {"cache_control": 3, "is_error": 2,
                                                     "metadata": 1},
    "claude-code-2.1.332-first.json": _CLAUDE,
    "claude-code-2.1.332-tool-turns.json": {**_CLAUDE, "is_error": 1},
    "codex-0.171.0-first.json": _CODEX,
    "codex-0.171.0-tool-turn.json": _CODEX,
    "opencode-1.18.33-messages-title.json": {"cache_control": 3, "thinking": 1},
    "opencode-1.18.33-messages-tool-turns.json": {"cache_control": 3, "is_error": 1},
    "opencode-1.18.33-responses-title.json": {"include": 1, "reasoning_summary": 1,
                                              "store": 1},
    "opencode-1.18.33-responses-tool-turns.json": {"prompt_cache_key": 1, "store": 1},
    "qwen-code-0.24.4-messages-first.json": {"cache_control": 4, "thinking": 1},
    "qwen-code-0.24.4-messages-tool-turns.json": {"cache_control": 4, "is_error": 2,
                                                  "thinking": 1},
}


def load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


# ---- what the client said, read independently of the translation ---------------------------


def _texts(content) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    out = []
    for block in content:
        if block.get("type") in ("text", "input_text", "output_text"):
            out.append(block["text"])
        elif block.get("type") == "tool_result":
            out.extend(_texts(block.get("content")))
    return out


def client_view(api: str, body: dict) -> dict:
    texts, calls, results, tools = [], [], [], []
    if api == "messages":
        texts += _texts(body.get("system"))
        for turn in body["messages"]:
            texts += _texts(turn["content"])
            for block in turn["content"] if isinstance(turn["content"], list) else ():
                if block["type"] == "tool_use":
                    calls.append((block["id"], block["name"], block["input"]))
                elif block["type"] == "tool_result":
                    results.append(block["tool_use_id"])
        tools = [(t["name"], t["input_schema"]) for t in body.get("tools", ())
                 if t.get("type") in (None, "custom") and not t.get("defer_loading")]
    else:
        texts += _texts(body.get("instructions"))
        for item in body["input"]:
            kind = item.get("type", "message")
            if kind == "message":
                texts += _texts(item["content"])
            elif kind == "function_call":
                calls.append((item["call_id"], item["name"], json.loads(item["arguments"])))
            elif kind == "function_call_output":
                texts += _texts(item["output"])
                results.append(item["call_id"])
        tools = [(t["name"], t["parameters"]) for t in body.get("tools", ())
                 if t["type"] == "function"]
    return {"texts": texts, "calls": calls, "results": results, "tools": tools}


def chat_view(chat: dict) -> dict:
    texts, calls, results = [], [], []
    for message in chat["messages"]:
        texts += _texts(message["content"])
        calls += [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                  for c in message.get("tool_calls", ())]
        if message["role"] == "tool":
            results.append(message["tool_call_id"])
    tools = [(t["function"]["name"], t["function"].get("parameters"))
             for t in chat.get("tools", ())]
    return {"texts": texts, "calls": calls, "results": results, "tools": tools}


# ---- replay --------------------------------------------------------------------------------


def test_every_fixture_has_its_expected_drops():
    assert sorted(DROPPED) == TRANSLATED  # a new fixture needs its row


@pytest.mark.parametrize("name", TRANSLATED)
def test_captured_request_translates_to_an_equivalent_chat_request(name, engine):
    fixture = load(name)
    dropped = Dropped()
    chat = TO_CHAT[fixture["api"]](fixture["body"], dropped=dropped, flavor="vllm")
    assert chat_view(chat) == client_view(fixture["api"], fixture["body"])
    assert dropped.counts == DROPPED[name]
    assert chat["stream"] is fixture["body"]["stream"] is True
    assert [m["role"] for m in chat["messages"]].count("system") >= 1
    # The engine takes it as a chat request (short answer: the prompt is what matters).
    status, reply = post(engine.url + "/chat/completions",
                         {**chat, "stream": False, "stream_options": None, "max_tokens": 4,
                          "logprobs": True}, timeout=60)
    assert status == 200, reply
    assert reply["choices"][0]["logprobs"]["content"]


def test_claude_code_thinking_settings_become_the_engines_options():
    """2.1.197 turns thinking off for its subagents and asks for effort high."""
    body = load("claude-code-2.1.197-subagent-tool-turns.json")["body"]
    assert body["thinking"] == {"type": "disabled"}
    chat = messages_to_chat(body, flavor="vllm")
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    assert chat["reasoning_effort"] == body["output_config"]["effort"] == "high"
    dropped = Dropped()
    assert "chat_template_kwargs" not in messages_to_chat(body, flavor="openai",
                                                          dropped=dropped)
    assert dropped.counts["thinking"] == 1


def test_claude_code_system_turns_land_in_place():
    body = load("claude-code-2.1.332-tool-turns.json")["body"]
    chat = messages_to_chat(body)
    client_roles = [t["role"] for t in body["messages"]]
    assert client_roles[:2] == ["user", "system"]
    # The system prompt, then the turns in order: the system turn right after the user's.
    assert [m["role"] for m in chat["messages"]][:3] == ["system", "user", "system"]
    assert _texts(chat["messages"][2]["content"]) == _texts(body["messages"][1]["content"])


# ---- end to end: the real SDKs, the proxy, the mock engine -----------------------------------


def _split(create, body: dict) -> tuple[dict, dict]:
    """The SDK method's own keyword arguments, and the rest as extra_body."""
    known = set(inspect.signature(create).parameters)
    return ({k: v for k, v in body.items() if k in known},
            {k: v for k, v in body.items() if k not in known})


def test_claude_code_request_through_the_proxy_is_captured_with_its_drops(proxy):
    """The request Claude Code 2.1.197 sends first: a 400 before translation was tolerant
    (2.1.332's is replayed above; the proxy path is the same)."""
    name = "claude-code-2.1.197-first.json"
    body = {**load(name)["body"], "max_tokens": 32}
    body.pop("stream")
    client = anthropic.Anthropic(base_url=proxy.url + "/episodes/cc", api_key="x",
                                 max_retries=0)
    with client:
        kwargs, extra = _split(client.messages.create, body)
        reply = client.messages.create(**kwargs, extra_body=extra)
    assert reply.content and reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
    (call,) = proxy.calls("cc")
    assert call["endpoint"] == "messages:chat" and call["http_status"] == 200
    choice = call["choices"][0]
    assert choice["completion_ids"] and len(choice["completion_logprobs"]) == len(
        choice["completion_ids"])
    assert json.loads(call["translation_dropped"]) == DROPPED[name]
    sent = json.loads(call["upstream_request"])
    assert [m["role"] for m in sent["messages"]] == ["system", "user", "system"]
    assert sent["reasoning_effort"] == body["output_config"]["effort"]
    metrics = metrics_text(proxy.url)
    assert ('tracetap_translation_dropped_total{api="messages",field="context_management"} '
            '1.0') in metrics
    assert 'tracetap_translation_dropped_total{api="messages",field="cache_control"} 3.0' in (
        metrics)
    status, page = fetch("GET", f"{proxy.url}/tracetap/ui/calls/{call['call_id']}",
                         token=proxy.admin_token)
    assert status == 200, page
    html = page.decode()
    assert "Left out by translation" in html and "cache_control \u00d73" in html


def test_codex_request_on_vllm_is_translated_and_every_token_kept(proxy):
    """Codex offers tools: under --translate auto on vLLM the call goes through chat, so a
    tool-call-only reply still has its ids and logprobs."""
    body = load("codex-0.171.0-tool-turn.json")["body"]
    body = {**body, "model": "mock-model", "max_output_tokens": 64}
    body.pop("stream")
    client = openai.OpenAI(base_url=proxy.episode_url("cx"), api_key="x", max_retries=0)
    with client:
        kwargs, extra = _split(client.responses.create, body)
        reply = client.responses.create(**kwargs, extra_body=extra)
    assert reply.output
    (call,) = proxy.calls("cx")
    assert call["endpoint"] == "responses:chat" and call["http_status"] == 200
    choice = call["choices"][0]
    assert choice["completion_ids"] and len(choice["completion_logprobs"]) == len(
        choice["completion_ids"])
    assert json.loads(call["translation_dropped"]) == _CODEX
