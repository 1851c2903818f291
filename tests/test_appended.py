"""The upstream body as the client's bytes plus capture's members (proxy.call.appended),
and the cases where it must not be (the caller encodes the payload whole)."""

from __future__ import annotations

import json

import msgspec

from tracetap.proxy.apis.chat import CHAT
from tracetap.proxy.apis.chat.inject import prepare
from tracetap.proxy.call.appended import appended

BODY = b'{"model": "m",\n "messages": [{"role": "user", "content": "h\\u00e9"}], "stream": true}\n'


def _prepared(body: bytes) -> tuple[dict, dict]:
    payload = msgspec.json.decode(body)
    before = dict(payload)
    prepare(payload, CHAT, "vllm")
    return before, payload


def test_the_added_members_follow_the_client_s_bytes():
    before, payload = _prepared(BODY)
    out = appended(BODY, before, payload)
    assert out is not None and out.startswith(BODY.rstrip()[:-1] + b',"logprobs":true')
    assert json.loads(out) == payload  # the same object, member for member


def test_nothing_added_is_the_client_s_body_itself():
    payload = msgspec.json.decode(BODY)
    assert appended(BODY, dict(payload), payload) is BODY


def test_a_replaced_member_falls_back():
    body = BODY.replace(b'"stream": true', b'"stream": true, "logprobs": false')
    before, payload = _prepared(body)
    assert payload["logprobs"] is True
    assert appended(body, before, payload) is None


def test_a_replaced_stream_options_falls_back():
    body = BODY.replace(b'"stream": true',
                        b'"stream": true, "stream_options": {"include_usage": false}')
    before, payload = _prepared(body)
    assert appended(body, before, payload) is None
    assert before["stream_options"] == {"include_usage": False}  # not edited in place


def test_a_removed_member_falls_back():
    payload = msgspec.json.decode(BODY)
    before = dict(payload)
    del payload["stream"]
    payload["logprobs"] = True
    assert appended(BODY, before, payload) is None


def test_an_empty_object_falls_back():
    payload: dict = {}
    assert appended(b"{}", {}, {"logprobs": True}) is None
    assert appended(b"{}", dict(payload), payload) is None
