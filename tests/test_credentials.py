"""One rule hides credentials in what the viewer shows or serves (storage.credentials):
by key name, inside JSON inside JSON (a tool call's arguments) to a fixed point, and after
``NAME:``/``NAME=`` in text; a body with nothing to hide is served as it was."""

from __future__ import annotations

import json

import pytest

from tracetap.storage.credentials import HIDDEN, KEY, mask_body, mask_text


@pytest.mark.parametrize("name", [
    "api_key", "apiKey", "OPENAI_API_KEY", "x-api-key", "password", "db_password", "passwd",
    "secret", "client_secret", "aws_secret_access_key", "private_key", "Authorization",
    "Cookie", "access_token", "accessToken", "auth_token", "id_token", "github_token",
    "credentials"])
def test_credential_names(name):
    assert KEY.match(name)


@pytest.mark.parametrize("name", [
    "token", "max_tokens", "prompt_tokens", "eos_token", "top_logprobs", "keyword", "key",
    "passage", "secretary", "tool_call_id"])
def test_not_credential_names(name):
    assert not KEY.match(name)


def test_json_inside_json_is_decoded_to_a_fixed_point():
    inner = json.dumps({"api_key": "sk-inner"})
    arguments = json.dumps({"password": "pw-1", "target": "prod", "config": inner,
                            "twice": json.dumps(json.dumps({"secret": "s-2"}))})
    body = json.dumps({"model": "m", "api_key": "sk-body", "max_tokens": 5,
                       "logprobs": {"content": [{"token": "hi"}]},
                       "messages": [{"role": "assistant", "tool_calls": [
                           {"function": {"name": "deploy", "arguments": arguments}}]}]})
    out = mask_body(body)
    for secret in ("sk-inner", "pw-1", "sk-body", "s-2"):
        assert secret not in out
    value = json.loads(out)
    assert value["max_tokens"] == 5 and value["logprobs"]["content"][0]["token"] == "hi"
    args = json.loads(value["messages"][0]["tool_calls"][0]["function"]["arguments"])
    assert args["target"] == "prod" and args["password"] == HIDDEN
    assert json.loads(args["config"]) == {"api_key": HIDDEN}
    assert json.loads(json.loads(args["twice"])) == {"secret": HIDDEN}  # as deep as it was


def test_text_and_untouched_bodies():
    text = ('export OPENAI_API_KEY=sk-env\nAuthorization: Bearer abc.def\n'
            'password="quoted pass" ok; {"auth_token": "t-1"} \\"client_secret\\": \\"c-2\\"')
    out = mask_text(text)
    for secret in ("sk-env", "abc.def", "quoted pass", "t-1", "c-2"):
        assert secret not in out
    assert out.endswith('\\"client_secret\\": \\"' + HIDDEN + '\\"') and "ok;" in out
    plain = '{"model": "m",  "messages": [{"role": "user", "content": "the key: is tokens"}]}'
    assert mask_body(plain) is plain  # nothing to hide: byte for byte
    assert mask_text("max_tokens: 5, the token count") == "max_tokens: 5, the token count"
    assert mask_body("not json, password=hunter2") == f"not json, password={HIDDEN}"
