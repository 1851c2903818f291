"""The untrusted agent against episodes, budgets, secrets and bad input (issue 25, points
3, 4, 7 and 8): each attack runs against a logging upstream that records what reaches it.

- A registered episode takes calls only from whoever holds its key (in its base URL or
  as the API key); relayed paths check episode ids like model calls.
- A token budget holds against parallel calls and against several proxies on one database.
- Credentials in an --upstream URL never show, and work.
- Bad input is a 4xx in the client's own shape, stored with its real status; the viewer
  shows every stored call; unforeseen failures are counted and their tracebacks limited.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import urllib.request

import anthropic
import msgspec
import openai
import pytest
import test_hostile_agent
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hostile_agent import MESSAGES, _raw, _refused
from test_viewer import _get

from conftest import Proxy, free_port
from tracetap.migrations import upgrade
from tracetap.proxy import failures
from tracetap.proxy.budgets import Budget, Budgets, reservation_size
from tracetap.proxy.settings import Settings
from tracetap.storage import budget_ledger

# The logging upstream and what it saw, shared with the first round of these attacks.
seen = test_hostile_agent.seen
upstream = test_hostile_agent.upstream


def _proxy(loop_thread, upstream: str, db: str, tmp_path, name: str = "p", **options) -> Proxy:
    settings = Settings(upstream=upstream, db=db, data_dir=str(tmp_path / name),
                        port=free_port(), upstream_flavor="vllm", **options)
    return Proxy(loop_thread, settings).start()


@pytest.fixture
def hostile(loop_thread, upstream, tmp_path):
    db = f"sqlite:///{tmp_path / 'h.db'}"
    upgrade(db)
    proxy = _proxy(loop_thread, upstream, db, tmp_path, allow_path=["POST /v1/embeddings"])
    yield proxy
    proxy.stop()


def _register(proxy, episode: str, **spec) -> dict:
    status, created = proxy.admin("POST", "/tracetap/episodes", {"id": episode, **spec})
    assert status == 201, created
    return created


def _model_posts(seen) -> int:
    return sum(1 for method, path, _ in seen if method == "POST")


# ---- 3. an episode's calls come from whoever holds its key ---------------------------------

def test_a_registered_episode_refuses_calls_without_its_key(hostile, seen):
    created = _register(hostile, "victim")
    secret = created["base_url"].split("/episodes/")[1].split("/")[0]
    assert secret.startswith("victim~") and secret[len("victim~"):] == created["api_key"][3:]
    spoofs = [
        openai.OpenAI(base_url=f"{hostile.url}/episodes/victim/v1", api_key="sk-x"),
        openai.OpenAI(base_url=hostile.url + "/v1", api_key="sk-x",
                      default_headers={"X-Tracetap-Episode": "victim"}),
    ]
    for client in spoofs:
        with client, pytest.raises(openai.PermissionDeniedError) as refused:
            client.with_options(max_retries=0).chat.completions.create(
                model="mock-model", messages=MESSAGES, max_tokens=2)
        assert refused.value.code == "episode_credential_required"
    with anthropic.Anthropic(base_url=f"{hostile.url}/episodes/victim", api_key="k",
                             max_retries=0) as client, pytest.raises(
            anthropic.PermissionDeniedError) as refused:
        client.messages.create(model="mock-model", max_tokens=2, messages=MESSAGES)
    assert refused.value.body["error"]["type"] == "permission_error"
    # A guessed secret is no key at all; the id alone on a relayed path is refused too.
    status, body = _raw(hostile, "POST", "/episodes/victim~guess/v1/chat/completions",
                        {"Content-Type": "application/json"}, b"{}")
    assert (status, body["error"]["code"]) == (401, "invalid_api_key")
    status, body = _raw(hostile, "GET", "/episodes/victim/v1/models")
    assert (status, body["error"]["code"]) == (403, "episode_credential_required")
    assert seen == []
    assert _refused(hostile, "episode_credential_required") == 4
    assert hostile.calls("victim") == []
    # The holder of the base URL needs nothing else (a harness that sets only a base URL).
    with openai.OpenAI(base_url=created["base_url"], api_key="unused", max_retries=0) as own:
        assert own.chat.completions.create(model="mock-model", messages=MESSAGES,
                                           max_tokens=2).choices
        assert [m.id for m in own.models.list().data] == ["mock-model"]
    with anthropic.Anthropic(base_url=created["base_url"][:-3], api_key="unused",
                             max_retries=0) as own:
        assert own.messages.create(model="mock-model", max_tokens=2, messages=MESSAGES).content
    assert [c["status"] for c in hostile.calls("victim")] == ["ok", "ok"]
    # Unregistered ids stay open by path, unless registration is required.
    with openai.OpenAI(base_url=f"{hostile.url}/episodes/open/v1", api_key="x",
                       max_retries=0) as open_client:
        assert open_client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                                   max_tokens=2).choices
        hostile.state.tagger.require_registered = True
        with pytest.raises(openai.NotFoundError):
            open_client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                                max_tokens=2)


def test_a_base_url_minted_on_one_proxy_opens_its_episode_on_another(hostile, loop_thread,
                                                                       tmp_path, seen):
    created = _register(hostile, "roams")
    replica = Proxy(loop_thread, msgspec.structs.replace(
        hostile.settings, port=free_port(), data_dir=str(tmp_path / "replica"))).start()
    try:
        base_url = created["base_url"].replace(hostile.url, replica.url)
        with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
            assert client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                                  max_tokens=2).choices
        status, body = _raw(replica, "POST", "/episodes/roams/v1/chat/completions",
                            {"Content-Type": "application/json"}, b"{}")
        assert (status, body["error"]["code"]) == (403, "episode_credential_required")
        assert [c["episode_id"] for c in replica.calls("roams")] == ["roams"]
    finally:
        replica.stop()


@pytest.mark.parametrize("where", ["path", "header"])
def test_relayed_paths_check_episode_ids_like_model_calls(hostile, seen, where):
    for bad in ("x" * 8000, "../../x", "a b", "é"):
        quoted = urllib.request.quote(bad, safe="")
        if where == "path":
            status, body = _raw(hostile, "POST", f"/episodes/{quoted}/v1/embeddings",
                                {"Content-Type": "application/json"}, b"{}")
        else:
            status, body = _raw(hostile, "POST", "/v1/embeddings",
                                {"Content-Type": "application/json",
                                 "X-Tracetap-Episode": quoted}, b"{}")
        assert status in (400, 404), bad[:20]
        assert body["error"]["code"] in ("invalid_episode_id", "invalid_path"), body
    assert seen == []
    assert hostile.calls(None) == []


# ---- 4. budgets hold against concurrency and processes -------------------------------------

def test_no_budget_means_no_database_on_the_call():
    budgets = Budgets(Budget(), engine=None)  # any use of the database would raise
    budgets.registered("registered-here", None)

    async def admit():
        return [await budgets.reserve("open", 100, keyed=False),
                await budgets.reserve("registered-here", 100, keyed=True),
                await budgets.reserve(None, 100, keyed=False)]

    assert asyncio.run(admit()) == [None, None, None]


def test_a_reservation_is_the_completion_cap_plus_the_prompt_bytes():
    assert reservation_size({"max_tokens": 16}, 100) == 116
    assert reservation_size({"max_completion_tokens": 8, "max_tokens": 99, "n": 2}, 10) == 26
    assert reservation_size({"max_output_tokens": 5}, 1) == 6
    assert reservation_size({"max_tokens": "many"}, 1) == 4097  # stated default: 4096


def _spend_concurrently(proxies, base_urls, calls: int, max_tokens: int):
    """``calls`` parallel chat calls spread over ``proxies``: (usage totals of the answered
    ones, status codes of the refused ones)."""

    async def one(i: int):
        client = openai.AsyncOpenAI(base_url=base_urls[i % len(base_urls)], api_key="unused",
                                    max_retries=0)
        async with client:
            try:
                reply = await client.chat.completions.create(
                    model="mock-model", messages=MESSAGES, max_tokens=max_tokens)
            except openai.APIStatusError as error:
                return "refused", error.status_code
            return "answered", reply.usage.total_tokens

    async def all_calls():
        return await asyncio.gather(*(one(i) for i in range(calls)))

    results = asyncio.run(all_calls())
    return ([n for kind, n in results if kind == "answered"],
            [n for kind, n in results if kind == "refused"])


@pytest.mark.parametrize("replicas", [1, 2])
def test_parallel_calls_through_several_proxies_spend_at_most_the_budget(
        loop_thread, upstream, db_url, tmp_path, seen, replicas):
    upgrade(db_url)
    proxies = [_proxy(loop_thread, upstream, db_url, tmp_path, f"p{i}")
               for i in range(replicas)]
    try:
        limit = 300
        created = _register(proxies[0], "tight", budget={"max_tokens": limit})
        base_urls = [created["base_url"].replace(proxies[0].url, p.url) for p in proxies]
        spent, refused = _spend_concurrently(proxies, base_urls, 50, max_tokens=16)
        assert spent and refused
        assert set(refused) <= {403, 429}
        assert _model_posts(seen) == len(spent)  # refused calls never reach the engine
        for proxy in proxies:
            proxy.loop.run(proxy.state.budgets.settled())
        ledger = loop_thread.run(budget_ledger.spent(proxies[0].state.engine, "tight"))
        assert ledger.tokens_reserved == 0 and ledger.tokens_used == sum(spent)
        one_reservation = reservation_size({"max_tokens": 16}, len(json.dumps(
            {"messages": MESSAGES, "model": "mock-model", "max_tokens": 16})))
        assert sum(spent) <= limit + one_reservation  # the documented rule
        assert max(spent) <= one_reservation  # each call stayed within what it reserved
    finally:
        for proxy in proxies:
            proxy.stop()


def test_a_calls_budget_holds_across_proxies_on_postgres(loop_thread, upstream, fresh_postgres,
                                                         tmp_path, seen):
    upgrade(fresh_postgres)
    proxies = [_proxy(loop_thread, upstream, fresh_postgres, tmp_path, f"p{i}")
               for i in range(2)]
    try:
        created = _register(proxies[1], "counted", budget={"max_calls": 5})
        base_urls = [created["base_url"].replace(proxies[1].url, p.url) for p in proxies]
        spent, refused = _spend_concurrently(proxies, base_urls, 20, max_tokens=2)
        assert len(spent) == 5 and refused == [403] * 15
        assert _model_posts(seen) == 5
    finally:
        for proxy in proxies:
            proxy.stop()


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
        with urllib.request.urlopen(proxy.url + path, timeout=30) as reply:
            shown.append(reply.read().decode())
    calls = {}
    for _ in range(300):  # the subprocess's writer commits every 50 ms
        status, calls = proxy.admin("GET", "/tracetap/episodes/c1", token="file-token-81")
        if status == 200 and calls["calls"]:
            break
        time.sleep(0.05)
    call_id = calls["calls"][0]["call_id"]
    page = _get(f"{proxy.url}/tracetap/ui/calls/{call_id}", "file-token-81")
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
    status, body = _raw(hostile, "POST", "/episodes/bad/v1/chat/completions",
                        {"Content-Type": "application/json"},
                        f'{{"model": "m", "messages": {deep}}}'.encode())
    assert (status, body["error"]["code"]) == (400, "invalid_json")
    status, body = _raw(hostile, "POST", "/episodes/bad/v1/messages",
                        {"Content-Type": "application/json", "anthropic-version": "2023-06-01"},
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
        status, body = _raw(hostile, "POST", f"/episodes/bad/v1/{path}",
                            {"Content-Type": "application/json"}, body.encode())
        assert 400 <= status < 500, (path, body)
    calls = hostile.calls("bad")
    assert len(calls) == 10
    assert _internal_errors(hostile) == 0
    for call in calls:
        status, _, page = _get(f"{hostile.url}/tracetap/ui/calls/{call['call_id']}",
                               hostile.admin_token)
        assert status == 200, page[:300]


def test_a_flood_of_bad_requests_logs_no_traceback_per_request(hostile, seen, caplog,
                                                                 monkeypatch):
    caplog.set_level(logging.INFO, logger="tracetap")
    for _ in range(40):  # refused: nothing for the log at all
        _raw(hostile, "POST", "/episodes/flood/v1/chat/completions",
             {"Content-Type": "application/json"}, b'{"model": "m", "logprobs": "yes"}')
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []

    def broken(payload):  # stands in for a bug the next bad input finds
        raise KeyError("a bug")

    monkeypatch.setattr(hostile.state.model_map, "apply", broken)
    for i in range(30):
        path, headers = (("messages", {"anthropic-version": "2023-06-01"}) if i % 2 else
                         ("chat/completions", {}))
        status, body = _raw(hostile, "POST", f"/episodes/flood/v1/{path}",
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
        status, reply = _raw(hostile, "POST", f"/episodes/fuzz/v1/{api}", headers, body)
        if status >= 400 and "raw" not in reply:
            if api == "messages":
                assert reply["type"] == "error", reply
            else:
                assert "error" in reply, reply
        assert _internal_errors(hostile) == 0, (changes, status, reply)

    check()
