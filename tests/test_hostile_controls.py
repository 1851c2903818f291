"""Agents send samples, not engine controls.

Inside an allowed model request the agent can name fields that steer the engine rather
than the sample (scheduling priority, request ids, KV-transfer peers, LoRA paths,
serialized logit processors, hidden states, engine-specific extra args). Per API, the
recording engine must receive exactly the documented sampling/chat fields plus what the
proxy itself asks for capture; every other field is dropped and counted by name, unless
the operator lets it through (``--allow-request-field``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import anthropic
import openai
import pytest
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.proxy.runtime.settings import Settings

# What vLLM and SGLang accept on their OpenAI routes to steer the engine itself.
CONTROLS = {
    "priority": -100,
    "request_id": "fixed-by-the-agent",
    "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.6.6.6"},
    "lora_request": {"lora_name": "x", "lora_path": "/tmp/evil"},
    "logits_processors": ["evil_module.Processor"],
    "vllm_xargs": {"steer": 1},
    "extra_args": {"steer": 1},
    "custom_logit_processor": "gASVPAAAAAAAAACMCGJ1aWx0aW5zlIwEZXZhbJSTlC4=",
    "return_hidden_states": True,
    "bootstrap_host": "10.6.6.6",
    "bootstrap_room": 7,
    "chat_template": "{{ 'the agent writes the template' }}",
    "use_beam_search": True,
    "a_future_engine_knob": 1,
}
NAMED = {k: 1 for k in CONTROLS if k != "a_future_engine_knob"} | {"other": 1}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def start(loop_thread, recording_engine, tmp_path, migrated_sqlite):
    """A proxy in front of the recording engine, with ``overrides`` to its settings."""
    proxies = []

    def go(**overrides) -> Proxy:
        settings = Settings(upstream=recording_engine, upstream_flavor="vllm",
                            db=migrated_sqlite(tmp_path / f"c{len(proxies)}.db"),
                            data_dir=str(tmp_path / f"data{len(proxies)}"), port=free_port(),
                            **overrides)
        proxies.append(Proxy(loop_thread, settings).start())
        return proxies[-1]

    yield go
    for proxy in proxies:
        proxy.stop()


def dropped(proxy, route: str) -> dict[str, float]:
    """``tracetap_request_fields_dropped_total`` of ``route``, by field (read after the
    proxy's loop has run the metrics it schedules once a reply is out)."""
    proxy.flush()
    pattern = re.compile(r'tracetap_request_fields_dropped_total\{field="([^"]+)",'
                         rf'route="{route}"\}} (\S+)')
    return {m[1]: float(m[2]) for m in pattern.finditer(proxy.state.metrics.render().decode())}


def _openai(proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.episode_url("e1"), api_key="sk-agent", max_retries=0)


def test_chat_forwards_its_sampling_fields_and_nothing_else(start, bodies):
    proxy = start()
    with _openai(proxy) as client:
        client.chat.completions.create(
            model="mock-model", messages=MESSAGES, max_tokens=4, temperature=0.5, seed=3,
            extra_body={**CONTROLS, "top_k": 5, "min_p": 0.1, "stop_token_ids": [7],
                        "chat_template_kwargs": {"enable_thinking": False}})
    [(path, sent)] = bodies
    assert path == "/v1/chat/completions"
    assert sent == {
        "model": "mock-model", "messages": MESSAGES, "max_tokens": 4, "temperature": 0.5,
        "seed": 3, "top_k": 5, "min_p": 0.1, "stop_token_ids": [7],
        "chat_template_kwargs": {"enable_thinking": False},
        # what capture asks for (and takes out of the reply again)
        "logprobs": True, "top_logprobs": 0, "return_token_ids": True,
    }
    assert dropped(proxy, "chat_completions") == NAMED
    # The stored call keeps the request as sent, and the body the engine got beside it.
    [call] = proxy.calls("e1")
    assert json.loads(call["request"])["priority"] == -100
    assert "priority" not in json.loads(call["upstream_request"])


def test_completions_stream_forwards_its_sampling_fields_and_nothing_else(start, bodies):
    proxy = start()
    with _openai(proxy) as client:
        list(client.completions.create(
            model="mock-model", prompt="hi", max_tokens=4, stream=True, top_p=0.9,
            extra_body={**CONTROLS, "repetition_penalty": 1.1, "best_of": 4}))
    [(path, sent)] = bodies
    assert path == "/v1/completions"
    assert sent == {
        "model": "mock-model", "prompt": "hi", "max_tokens": 4, "stream": True, "top_p": 0.9,
        "repetition_penalty": 1.1,
        "logprobs": 0, "stream_options": {"include_usage": True}, "return_token_ids": True,
    }
    assert dropped(proxy, "completions") == NAMED | {"best_of": 1}


def test_responses_native_forwards_its_fields_and_nothing_else(start, bodies):
    proxy = start(translate="none")  # vLLM serves the Responses API itself
    with _openai(proxy) as client:
        client.responses.create(model="mock-model", input="hi", max_output_tokens=4,
                                temperature=0.2, extra_body={**CONTROLS, "top_k": 3})
    [(path, sent)] = bodies
    assert path == "/v1/responses"
    assert sent == {
        "model": "mock-model", "input": "hi", "max_output_tokens": 4, "temperature": 0.2,
        "top_k": 3, "include": ["message.output_text.logprobs"],
        "enable_response_messages": True,
    }
    assert dropped(proxy, "responses") == NAMED


@pytest.mark.parametrize("translate", ["none", "auto"])
def test_messages_forward_their_fields_and_nothing_else(start, bodies, translate):
    proxy = start(translate=translate)  # auto: Messages are translated to chat
    agent = anthropic.Anthropic(base_url=proxy.url + "/episodes/e1", api_key="x",
                                max_retries=0)
    with agent:
        agent.messages.create(model="mock-model", max_tokens=4, messages=MESSAGES,
                              extra_body={**CONTROLS, "top_k": 2})
    [(path, sent)] = bodies
    if translate == "none":
        assert path == "/v1/messages"
        assert sent == {"model": "mock-model", "max_tokens": 4, "messages": MESSAGES,
                        "top_k": 2}
        assert dropped(proxy, "messages") == NAMED
    else:
        assert path == "/v1/chat/completions"
        assert sent == {"model": "mock-model", "messages": MESSAGES, "max_tokens": 4,
                        "top_k": 2, "logprobs": True, "top_logprobs": 0,
                        "return_token_ids": True}
        # The named controls are counted here; the unknown one is translation's to count.
        assert dropped(proxy, "messages") == {k: 1 for k in NAMED if k != "other"}
        [call] = proxy.calls("e1")
        assert json.loads(call["translation_dropped"]) == {"other": 1}


def test_the_operator_lets_a_field_through_by_name(start, bodies):
    proxy = start(allow_request_field=["priority", "a_future_engine_knob"])
    with _openai(proxy) as client:
        client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=2,
                                       extra_body=CONTROLS)
    [(_, sent)] = bodies
    assert sent["priority"] == -100 and sent["a_future_engine_knob"] == 1
    assert "request_id" not in sent and "kv_transfer_params" not in sent
    assert dropped(proxy, "chat_completions") == {
        k: 1 for k in NAMED if k not in ("priority", "other")}


def test_a_plain_request_reaches_the_engine_whole_and_is_not_stored_apart(start, bodies):
    """An agent that sent only allowed fields and asked for what capture needs itself:
    the engine gets every member as sent, and no upstream body is stored beside the
    client's (nothing was dropped or rewritten)."""
    proxy = start()
    body = {"model": "mock-model", "messages": MESSAGES, "max_tokens": 2, "logprobs": True,
            "top_logprobs": 1, "return_token_ids": True}
    with _openai(proxy) as client:
        client.chat.completions.create(**{k: v for k, v in body.items()
                                          if k != "return_token_ids"},
                                       extra_body={"return_token_ids": True})
    assert bodies == [("/v1/chat/completions", body)]
    assert dropped(proxy, "chat_completions") == {}
    [call] = proxy.calls("e1")
    assert call["upstream_request"] is None


def test_allow_request_field_flag_and_environment():
    code = ("import argparse, sys; from tracetap.proxy.server import serve_flags as s;"
            "p = argparse.ArgumentParser(); s.add_serve_arguments(p);"
            "print(s.settings_from_args(p.parse_args(sys.argv[1:])).allow_request_field)")
    env = {**os.environ, "TRACETAP_ALLOW_REQUEST_FIELD": "priority,cache_salt"}
    run = [sys.executable, "-c", code, "--upstream", "http://127.0.0.1:9"]
    out = subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['priority', 'cache_salt']"
    out = subprocess.run([*run, "--allow-request-field", "lora_request"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['lora_request']"
    with pytest.raises(ValueError, match="--allow-request-field"):
        Settings(upstream=["http://127.0.0.1:9"], allow_request_field=["a b"])


def test_docs_list_exactly_the_fields_that_reach_the_engine():
    """docs/apis.md's allowlist table and its list of named controls are the code's."""
    from pathlib import Path

    from tracetap.proxy.apis import fields

    page = (Path(__file__).resolve().parent.parent / "docs" / "apis.md").read_text()
    section = page[page.index("## What the agent can ask of the engine"):]
    rows = {cells[1].strip(): set(re.findall(r"`([a-z_]+)`", cells[2]))
            for cells in (line.split("|") for line in section.splitlines())
            if len(cells) > 3 and cells[1].strip() in (
                "chat completions", "completions", "Responses (native)",
                "Messages (native, `--translate none`)",
                "engine sampling fields (chat and completions)")}
    engine = rows.pop("engine sampling fields (chat and completions)")
    assert rows["chat completions"] | engine == fields.ALLOWED["chat.completions"]
    assert rows["completions"] | engine == fields.ALLOWED["completions"]
    assert rows["Responses (native)"] == fields.ALLOWED["responses"]
    assert rows["Messages (native, `--translate none`)"] == fields.ALLOWED["messages"]
    named = section[section.index("Engine controls named"):]
    assert set(re.findall(r"`([a-z_]+)`", named.split("The operator")[0])) == (
        fields.CONTROLS - {fields.OTHER})
