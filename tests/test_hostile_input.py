"""The untrusted agent against secrets and bad input, with the
logging upstream of tests/test_hostile_agent.py:

- Credentials in an --upstream URL never show, and work.
- Bad input is a 4xx in the client's own shape, stored with its real status; the viewer
  shows every stored call; unforeseen failures are counted and their tracebacks limited;
  fuzzed requests of all three APIs never fail inside the proxy.
"""

from __future__ import annotations

import base64
import json
import logging
import time

import openai
import pytest
from helpers.hostile import MESSAGES, raw_request
from helpers.http import fetch, get_page
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracetap.proxy.http import failures
from tracetap.proxy.runtime.settings import Settings

# ---- 7. secrets stay secret -------------------------------------------------------------------

def test_upstream_url_credentials_are_used_and_never_shown(run_proxy, upstream, seen, tmp_path):
    host = upstream.split("://", 1)[1]
    secret_url = f"http://agent:s3cret-pw@{host}"
    token_file = tmp_path / "admin-token.txt"
    token_file.write_text("file-token-81\n")
    db = f"sqlite:///{tmp_path / 'c.db'}"
    proxy = run_proxy(secret_url, db, "--admin-token-file", str(token_file))
    with open(f"/proc/{proxy.process.pid}/cmdline", "rb") as cmdline:
        assert b"file-token-81" not in cmdline.read()
    assert proxy.admin("GET", "/tracetap/episodes", token="file-token-81")[0] == 200
    with openai.OpenAI(base_url=proxy.episode_url("c1"), api_key="x", max_retries=0) as client:
        assert client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                              max_tokens=2).choices
    basic = "Basic " + base64.b64encode(b"agent:s3cret-pw").decode()
    assert [auth for method, _, auth in seen if method == "POST"] == [basic]
    shown = []
    for path in ("/metrics", "/readyz"):
        status, page = fetch("GET", proxy.url + path)
        assert status == 200, page
        shown.append(page.decode())
    calls = {}
    for _ in range(300):  # the subprocess's writer commits every 50 ms
        status, calls = proxy.admin("GET", "/tracetap/episodes/c1", token="file-token-81")
        if status == 200 and calls["calls"]:
            break
        time.sleep(0.05)
    call_id = calls["calls"][0]["call_id"]
    page = get_page(f"{proxy.url}/tracetap/ui/calls/{call_id}", "file-token-81")
    shown += [json.dumps(calls), page[2], proxy.log.read_text()]
    proxy.stop()
    shown.append(proxy.log.read_text())
    with open(tmp_path / "c.db", "rb") as stored:
        shown.append(stored.read().decode("latin-1"))
    assert "***@" in shown[0] and "***@" in shown[1]
    for text in shown:
        assert "s3cret-pw" not in text and "agent:" not in text


def test_a_url_password_with_an_upstream_key_is_refused_at_start():
    with pytest.raises(ValueError, match=r"user:password@.*--upstream-api-key"):
        Settings(upstream="http://u:p@127.0.0.1:1/v1", upstream_api_key="k")
    with pytest.raises(ValueError, match="--forward-client-auth"):
        Settings(upstream="http://u:p@127.0.0.1:1/v1", forward_client_auth=True)


def _internal_errors(proxy) -> float:
    text = proxy.state.metrics.render().decode()
    return float(text.split("\ntracetap_internal_errors_total ")[1].split()[0])


# ---- 8. bad input -----------------------------------------------------------------------------

def test_bad_input_is_a_4xx_in_the_clients_shape_stored_and_viewable(hostile, seen):
    deep = "[" * 1000 + "]" * 1000
    with openai.OpenAI(base_url=hostile.episode_url("bad"), api_key="x",
                       max_retries=0) as client:
        for extra in ({"logprobs": "yes"}, {"logprobs": True, "top_logprobs": [1]},
                      {"top_logprobs": -1}):
            with pytest.raises(openai.BadRequestError):
                client.chat.completions.create(model="m", messages=MESSAGES, extra_body=extra)
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model="m", input="hi", extra_body={"top_logprobs": "x"})
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="m", prompt="hi", extra_body={"logprobs": "x"})
    status, body = raw_request(hostile, "POST", "/episodes/bad/v1/chat/completions",
                               {"Content-Type": "application/json"},
                               f'{{"model": "m", "messages": {deep}}}'.encode())
    assert (status, body["error"]["code"]) == (400, "invalid_json")
    status, body = raw_request(hostile, "POST", "/episodes/bad/v1/messages",
                               {"Content-Type": "application/json",
                                "anthropic-version": "2023-06-01"},
                               f'{{"model": "m", "max_tokens": 2, "messages": {deep}}}'.encode())
    assert status == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert seen == []
    calls = hostile.calls("bad")
    assert [(c["status"], c["http_status"]) for c in calls] == [("bad_request", 400)] * 7
    # Nested just within what the decoder takes: relayed (the engine judges it) or refused,
    # never a failure of the proxy's own.
    decodable = "[" * 990 + "]" * 990
    for path, body in [("chat/completions", f'{{"model": "m", "messages": {decodable}}}'),
                       ("responses", f'{{"model": "m", "input": {decodable}}}'),
                       ("messages", f'{{"model": "m", "max_tokens": 2, "messages": '
                                    f'[{{"role": "user", "content": {decodable}}}]}}')]:
        status, body = raw_request(hostile, "POST", f"/episodes/bad/v1/{path}",
                                   {"Content-Type": "application/json"}, body.encode())
        assert 400 <= status < 500, (path, body)
    calls = hostile.calls("bad")
    assert len(calls) == 10
    assert _internal_errors(hostile) == 0
    for call in calls:
        status, _, page = get_page(f"{hostile.url}/tracetap/ui/calls/{call['call_id']}",
                                   hostile.admin_token)
        assert status == 200, page[:300]


def test_a_flood_of_bad_requests_logs_no_traceback_per_request(hostile, seen, caplog,
                                                                 monkeypatch):
    caplog.set_level(logging.INFO, logger="tracetap")
    for _ in range(40):  # refused: nothing for the log at all
        raw_request(hostile, "POST", "/episodes/flood/v1/chat/completions",
                    {"Content-Type": "application/json"}, b'{"model": "m", "logprobs": "yes"}')
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []

    def broken(payload):  # stands in for a bug the next bad input finds
        raise KeyError("a bug")

    monkeypatch.setattr(hostile.state.model_map, "apply", broken)
    for i in range(30):
        path, headers = (("messages", {"anthropic-version": "2023-06-01"}) if i % 2 else
                         ("chat/completions", {}))
        status, body = raw_request(hostile, "POST", f"/episodes/flood/v1/{path}",
                                   {"Content-Type": "application/json", **headers},
                                   json.dumps({"model": "m", "max_tokens": 2,
                                        "messages": MESSAGES}).encode())
        assert status == 500
        if i % 2:
            assert body["type"] == "error" and body["error"]["type"] == "api_error"
        else:
            assert body["error"]["code"] == "internal_error"
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == failures.BURST
    assert _internal_errors(hostile) == 30
    assert seen == []
    stored = hostile.calls("flood")
    assert [(c["status"], c["http_status"]) for c in stored[-30:]] == [("error", 500)] * 30
    assert [(c["status"], c["http_status"]) for c in stored[:40]] == [("bad_request", 400)] * 40


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                               max_size=3),
    max_leaves=8)
_FIELDS = {
    "chat/completions": ["model", "messages", "logprobs", "top_logprobs", "max_tokens",
                         "max_completion_tokens", "n", "stream", "stream_options", "tools",
                         "tool_choice", "response_format", "stop"],
    "responses": ["model", "input", "instructions", "include", "top_logprobs",
                  "max_output_tokens", "stream", "tools", "text", "reasoning"],
    "messages": ["model", "messages", "system", "max_tokens", "stream", "tools",
                 "tool_choice", "stop_sequences", "thinking", "metadata"],
}
_VALID = {
    "chat/completions": {"model": "m", "messages": MESSAGES, "max_tokens": 2},
    "responses": {"model": "m", "input": "hi", "max_output_tokens": 2},
    "messages": {"model": "m", "messages": MESSAGES, "max_tokens": 2},
}


@pytest.mark.parametrize("api", list(_FIELDS))
def test_fuzzed_requests_never_fail_inside_the_proxy(hostile, api):
    """A valid request with a few fields replaced by any JSON: the proxy relays it or
    answers 4xx in the client's shape, never fails on its own."""

    @settings(max_examples=40, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.dictionaries(st.sampled_from(_FIELDS[api]), _VALUES, max_size=3))
    def check(changes):
        body = json.dumps({**_VALID[api], **changes}, allow_nan=True).encode()
        headers = {"Content-Type": "application/json"}
        if api == "messages":
            headers["anthropic-version"] = "2023-06-01"
        status, reply = raw_request(hostile, "POST", f"/episodes/fuzz/v1/{api}", headers, body)
        if status >= 400 and "raw" not in reply:
            if api == "messages":
                assert reply["type"] == "error", reply
            else:
                assert "error" in reply, reply
        assert _internal_errors(hostile) == 0, (changes, status, reply)

    check()


def test_tracebacks_come_back_each_minute_with_a_count_of_those_left_out(caplog):
    now = [0.0]
    counted = []
    failing = failures.Failures(counter=type("C", (), {"inc": lambda _: counted.append(1)})(),
                                clock=lambda: now[0])
    caplog.set_level(logging.ERROR, logger="tracetap")
    for _ in range(failures.BURST + 7):
        error = failing.internal(KeyError("bug"), "c1")
    assert (error.status, error.code) == (500, "internal_error")
    assert len([r for r in caplog.records if r.exc_info]) == failures.BURST
    now[0] += failures.WINDOW
    failing.internal(KeyError("bug"), "c2")
    summary = [r.getMessage() for r in caplog.records if not r.exc_info]
    assert summary == ["7 more requests failed inside the proxy in the last 60s (tracebacks "
                       "not logged; see tracetap_internal_errors_total)"]
    assert len([r for r in caplog.records if r.exc_info]) == failures.BURST + 1
    assert len(counted) == failures.BURST + 8
