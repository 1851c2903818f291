"""The untrusted agent against episodes and budgets: each
attack runs against a logging upstream that records what reaches it.

- A registered episode takes calls only from whoever holds its key (in its base URL or
  as the API key); relayed paths check episode ids like model calls.
- A token budget holds against parallel calls and against several proxies on one database.

Secrets and bad input (points 7 and 8) are in tests/test_hostile_input.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse

import anthropic
import msgspec
import openai
import pytest
from helpers.hostile import MESSAGES, raw_request, refused_count
from helpers.http import register
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.migrations import upgrade
from tracetap.proxy.apis.registry import caps
from tracetap.proxy.episodes.budgets import Budget, Budgets, reservation_size
from tracetap.proxy.runtime.settings import Settings
from tracetap.storage import budget_ledger


def _proxy(loop_thread, upstream: str, db: str, tmp_path, name: str = "p", **options) -> Proxy:
    settings = Settings(upstream=upstream, db=db, data_dir=str(tmp_path / name),
                        port=free_port(), upstream_flavor="vllm", **options)
    return Proxy(loop_thread, settings).start()


def _model_posts(seen) -> int:
    return sum(1 for method, path, _ in seen if method == "POST")


# ---- 3. an episode's calls come from whoever holds its key ---------------------------------

def test_a_registered_episode_refuses_calls_without_its_key(hostile, seen):
    created = register(hostile, "victim")
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
    status, body = raw_request(hostile, "POST", "/episodes/victim~guess/v1/chat/completions",
                               {"Content-Type": "application/json"}, b"{}")
    assert (status, body["error"]["code"]) == (401, "invalid_api_key")
    status, body = raw_request(hostile, "GET", "/episodes/victim/v1/models")
    assert (status, body["error"]["code"]) == (403, "episode_credential_required")
    assert seen == []
    assert refused_count(hostile, "episode_credential_required") == 4
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
    created = register(hostile, "roams")
    replica = Proxy(loop_thread, msgspec.structs.replace(
        hostile.settings, port=free_port(), data_dir=str(tmp_path / "replica"))).start()
    try:
        base_url = created["base_url"].replace(hostile.url, replica.url)
        with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
            assert client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                                  max_tokens=2).choices
        status, body = raw_request(replica, "POST", "/episodes/roams/v1/chat/completions",
                                   {"Content-Type": "application/json"}, b"{}")
        assert (status, body["error"]["code"]) == (403, "episode_credential_required")
        assert [c["episode_id"] for c in replica.calls("roams")] == ["roams"]
    finally:
        replica.stop()


def test_a_registration_on_one_proxy_closes_the_id_on_another_that_saw_it_open(
        hostile, loop_thread, tmp_path, seen):
    replica = Proxy(loop_thread, msgspec.structs.replace(
        hostile.settings, port=free_port(), data_dir=str(tmp_path / "replica"))).start()
    path = "/episodes/late/v1/chat/completions"
    body = json.dumps({"model": "mock-model", "messages": MESSAGES, "max_tokens": 2}).encode()
    headers = {"Content-Type": "application/json"}
    try:
        assert raw_request(replica, "POST", path, headers, body)[0] == 200  # open: never registered
        register(hostile, "late")
        for _ in range(200):  # the replica follows registrations every FOLLOW_SECONDS
            status, reply = raw_request(replica, "POST", path, headers, body)
            if status != 200:
                break
            time.sleep(0.05)
        assert (status, reply["error"]["code"]) == (403, "episode_credential_required")
    finally:
        replica.stop()


@pytest.mark.parametrize("where", ["path", "header"])
def test_relayed_paths_check_episode_ids_like_model_calls(hostile, seen, where):
    for bad in ("x" * 8000, "../../x", "a b", "é"):
        quoted = urllib.parse.quote(bad, safe="")
        if where == "path":
            status, body = raw_request(hostile, "POST", f"/episodes/{quoted}/v1/embeddings",
                                       {"Content-Type": "application/json"}, b"{}")
        else:
            status, body = raw_request(hostile, "POST", "/v1/embeddings",
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
    chat = "chat.completions"
    assert reservation_size(caps(chat, {"max_tokens": 16}), 100) == 116
    assert reservation_size(caps(chat, {"max_completion_tokens": 8, "max_tokens": 99, "n": 2}),
                            10) == 26
    assert reservation_size(caps("responses", {"max_output_tokens": 5}), 1) == 6
    assert reservation_size(caps(chat, {"max_tokens": "many"}), 1) == 4097  # default: 4096


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
        created = register(proxies[0], "tight", budget={"max_tokens": limit})
        base_urls = [created["base_url"].replace(proxies[0].url, p.url) for p in proxies]
        spent, refused = _spend_concurrently(proxies, base_urls, 50, max_tokens=16)
        assert spent and refused
        assert set(refused) <= {403, 429}
        assert _model_posts(seen) == len(spent)  # refused calls never reach the engine
        for proxy in proxies:
            proxy.loop.run(proxy.state.budgets.settled())
        ledger = loop_thread.run(budget_ledger.spent(proxies[0].state.engine, "tight"))
        assert ledger.tokens_reserved == 0 and ledger.tokens_used == sum(spent)
        one_reservation = reservation_size(caps("chat", {"max_tokens": 16}), len(json.dumps(
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
        created = register(proxies[1], "counted", budget={"max_calls": 5})
        base_urls = [created["base_url"].replace(proxies[1].url, p.url) for p in proxies]
        spent, refused = _spend_concurrently(proxies, base_urls, 20, max_tokens=2)
        assert len(spent) == 5 and refused == [403] * 15
        assert _model_posts(seen) == 5
    finally:
        for proxy in proxies:
            proxy.stop()


def test_an_agents_next_call_is_not_refused_for_what_its_last_call_held(
        loop_thread, upstream, tmp_path, monkeypatch):
    """A call's reservation is released off the call, in the background; an agent's next
    call follows its reply at once. Settlements are made slow here: without waiting for
    the episode's own, the third call would see two calls' reservations still held
    (85 tokens each against a budget of 120) and get 429 though it has room."""
    release = budget_ledger.settle

    async def slow_settle(*args):
        await asyncio.sleep(0.5)
        await release(*args)

    monkeypatch.setattr(budget_ledger, "settle", slow_settle)
    db = f"sqlite:///{tmp_path / 'b.db'}"
    upgrade(db)
    proxy = Proxy(loop_thread, Settings(upstream=upstream, db=db, data_dir=str(tmp_path / "d"),
                                        port=free_port(), episode_max_tokens=120)).start()
    try:
        client = openai.OpenAI(base_url=proxy.episode_url("next"), api_key="x", max_retries=0)
        with client:
            used = [client.chat.completions.create(model="mock-model", messages=MESSAGES,
                                                   max_tokens=4).usage.total_tokens
                    for _ in range(3)]
        assert sum(used) < 120 and len(used) == 3
    finally:
        proxy.stop()
