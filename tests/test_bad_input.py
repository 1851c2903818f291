"""Bad input gets an OpenAI-style JSON error and a stored call record, never a traceback."""

from __future__ import annotations

import json

import openai
import pytest
from helpers.http import post
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.proxy.runtime.settings import Settings


def _assert_openai_error(body: dict, code: str) -> None:
    error = body["error"]
    assert error["code"] == code
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_malformed_json_is_a_400_and_recorded(proxy, body):
    status, error = post(proxy.episode_url("badjson") + "/chat/completions", body)
    assert status == 400
    _assert_openai_error(error, "invalid_json")
    [call] = proxy.calls("badjson")
    assert call["status"] == "bad_request" and call["http_status"] == 400
    assert call["choices"] == []


def test_invalid_episode_id_is_a_400(proxy):
    bad = "x" * 129
    status, error = post(f"{proxy.url}/episodes/{bad}/v1/chat/completions", b"{}")
    assert status == 400
    _assert_openai_error(error, "invalid_episode_id")
    status, error = post(proxy.url + "/v1/chat/completions", b"{}",
                          {"X-Tracetap-Episode": "spaces are not allowed"})
    assert status == 400
    _assert_openai_error(error, "invalid_episode_id")
    untagged = proxy.calls(None)
    assert len(untagged) == 2 and {c["http_status"] for c in untagged} == {400}


def test_body_over_the_limit_is_a_413(loop_thread, engine, db_url, tmp_path):
    settings = Settings(upstream=engine.url, db=db_url, data_dir=str(tmp_path / "d"),
                        port=free_port(), max_body=1024)
    proxy = Proxy(loop_thread, settings).start()
    try:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 4096}]})
        status, error = post(proxy.episode_url("big") + "/chat/completions", body.encode())
        assert status == 413
        _assert_openai_error(error, "request_too_large")
        [call] = proxy.calls("big")
        assert call["http_status"] == 413 and call["status"] == "bad_request"
    finally:
        proxy.stop()


def test_unreachable_upstream_is_a_502(loop_thread, db_url, tmp_path):
    settings = Settings(upstream=f"http://127.0.0.1:{free_port()}/v1", db=db_url,
                        data_dir=str(tmp_path / "d"), port=free_port(), upstream_flavor="vllm")
    proxy = Proxy(loop_thread, settings).start()
    try:
        client = openai.OpenAI(base_url=proxy.episode_url("down"), api_key="x", max_retries=0)
        with client, pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert info.value.status_code == 502
        _assert_openai_error(info.value.body and {"error": info.value.body}, "upstream_unreachable")
        [call] = proxy.calls("down")
        assert call["status"] == "upstream_unreachable" and call["http_status"] == 502
    finally:
        proxy.stop()


def test_upstream_timeout_is_a_504(loop_thread, engine, db_url, tmp_path):
    settings = Settings(upstream=engine.url, db=db_url, data_dir=str(tmp_path / "d"),
                        port=free_port(), upstream_timeout=0.3)
    proxy = Proxy(loop_thread, settings).start()
    try:
        client = openai.OpenAI(base_url=proxy.episode_url("slow"), api_key="x", max_retries=0)
        with client, pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                           extra_body={"mock_delay_s": 2.0})
        assert info.value.status_code == 504
        [call] = proxy.calls("slow")
        assert call["status"] == "upstream_timeout" and call["http_status"] == 504
    finally:
        proxy.stop()


def test_upstream_error_body_passes_through_and_is_recorded(proxy, engine):
    direct = openai.OpenAI(base_url=engine.url, api_key="x", max_retries=0)
    proxied = openai.OpenAI(base_url=proxy.episode_url("upstream-4xx"), api_key="x",
                            max_retries=0)
    errors = []
    with direct, proxied:
        for client in (direct, proxied):
            with pytest.raises(openai.APIStatusError) as info:
                client.chat.completions.create(model="m", messages=[
                    {"role": "user", "content": "hi"}], extra_body={"mock_status": 429})
            errors.append((info.value.status_code, info.value.body))
    assert errors[0] == errors[1] and errors[0][0] == 429
    [call] = proxy.calls("upstream-4xx")
    assert call["http_status"] == 429 and call["status"] == "ok"
    assert json.loads(call["response"])["error"] == errors[0][1]
