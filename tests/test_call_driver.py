"""ModelCall as the one driver of a call: an overlay's review re-samples through
the call's own API, so the budget and journal rules hold for every attempt. Each test
spies on the proxy's own objects (the budgets, the writer, the client's writes) and
observes the order or the count, which reading the stored records afterwards cannot."""

from __future__ import annotations

import json

import pytest
from aiohttp import web
from helpers.chat_upstreams import chat_reply, scripted_chat_app
from helpers.http import fetch
from helpers.loop import free_port
from helpers.servers import Proxy

from tests.test_overlays import QUESTION, SYSTEM, chat, register
from tracetap.proxy.runtime.settings import Settings
from tracetap.storage import budget_ledger


@pytest.fixture
def proxy(loop_thread, engine, tmp_path, migrated_sqlite):
    url = migrated_sqlite(tmp_path / "tracetap.db")
    settings = Settings(upstream=engine.url, db=url, data_dir=str(tmp_path / "data"),
                        port=free_port(), episode_max_tokens=1_000_000,
                        overlay=["vetoer=tests.overlay_fixtures:first_vetoer"])
    p = Proxy(loop_thread, settings).start()
    yield p
    p.stop()


def _tokens(call: dict) -> int:
    return (call["prompt_tokens"] or 0) + (call["completion_tokens"] or 0)


@pytest.mark.parametrize("stream", [False, True])
def test_each_attempt_spends_its_own_tokens_once_and_the_reservation_is_settled_once(
        proxy, stream, monkeypatch):
    """A vetoed turn is two attempts: the re-sample spends its tokens from the first's
    reservation (once), and the first settles its reservation with its own tokens (once,
    when the call ends). Kills spending an attempt twice (its veto and its end), or the
    re-sample's tokens counted under the first's settlement."""
    budgets = proxy.state.budgets
    seen: list[tuple[str, int]] = []
    settle, spend = budgets.settle, budgets.spend
    monkeypatch.setattr(budgets, "settle",
                        lambda r, used: (seen.append(("settle", used)), settle(r, used))[1])
    monkeypatch.setattr(budgets, "spend",
                        lambda r, used: (seen.append(("spend", used)), spend(r, used))[1])
    episode = f"budget-{stream}"
    register(proxy, episode, overlay="vetoer")
    chat(proxy, episode, [SYSTEM, QUESTION], stream=stream)
    first, second = proxy.calls(episode)
    assert (first["status"], second["status"]) == ("vetoed", "ok")
    assert _tokens(first) and _tokens(second)
    assert sorted(seen) == [("settle", _tokens(first)), ("spend", _tokens(second))]
    proxy.loop.run(budgets.settled())
    spent = proxy.loop.run(budget_ledger.spent(proxy.state.engine, episode))
    assert spent.tokens_used == _tokens(first) + _tokens(second)
    assert spent.tokens_reserved == 0 and spent.calls == 1  # one call of the harness


def test_a_held_stream_is_journaled_before_its_end_reaches_the_client(proxy, monkeypatch):
    """The reviewed stream's end goes out through ``ModelCall.release``: both attempts'
    records are handed to the writer before the write that gives the client
    ``data: [DONE]``. Kills the journal moved after the held reply is written."""
    order: list[str] = []
    writer = proxy.state.writer
    submit = writer.submit

    def spied_submit(record, *rest):  # rest: the request's bytes (Writer.submit)
        order.append(f"submit {record.status}")
        return submit(record, *rest)

    write = web.StreamResponse.write

    async def spied_write(self, data):
        if b"data: [DONE]" in data:  # the engine's writes (each attempt's) and the proxy's
            server = "proxy" if self._req.url.port == proxy.settings.port else "engine"
            order.append(f"[DONE] written by the {server}")
        return await write(self, data)

    monkeypatch.setattr(writer, "submit", spied_submit)
    monkeypatch.setattr(web.StreamResponse, "write", spied_write)
    register(proxy, "held-order", overlay="vetoer")
    content, _ = chat(proxy, "held-order", [SYSTEM, QUESTION], stream=True)
    assert content
    assert order == ["[DONE] written by the engine", "submit vetoed",
                     "[DONE] written by the engine", "submit ok",
                     "[DONE] written by the proxy"]


def test_a_call_the_overlay_does_not_cover_goes_upstream_as_the_client_sent_it(proxy):
    """A completions call in an overlay's episode (not chat-shaped: no hook runs) is sent
    with the client's own body."""
    register(proxy, "uncovered", overlay="vetoer")
    body = {"model": "mock-model", "prompt": "Say it.", "max_tokens": 4}
    status, reply = fetch("POST", proxy.episode_url("uncovered") + "/completions", body)
    assert status == 200 and json.loads(reply)["choices"][0]["text"]
    [call] = proxy.calls("uncovered")
    assert call["status"] == "ok" and json.loads(call["request"]) == body


def test_a_call_reserves_its_own_completion_cap(proxy, monkeypatch):
    """The reservation is the client's ``max_tokens`` plus the body's bytes, not the
    default cap (kills the reservation sized from an empty payload)."""
    budgets, sizes = proxy.state.budgets, []
    reserve = budgets.reserve

    async def spied(episode_id, tokens, **kwargs):
        sizes.append(tokens)
        return await reserve(episode_id, tokens, **kwargs)

    monkeypatch.setattr(budgets, "reserve", spied)
    body = json.dumps({"model": "mock-model", "messages": [QUESTION], "max_tokens": 777})
    status, _ = fetch("POST", proxy.episode_url("capped") + "/chat/completions", body.encode())
    assert status == 200 and sizes == [777 + len(body)]


@pytest.mark.parametrize("usage", [{"completion_tokens": 3}, {"prompt_tokens": 5}])
def test_an_upstream_that_counts_only_some_tokens_spends_what_it_counted(
        loop_thread, serve_app, tmp_path, migrated_sqlite, usage):
    """A reply whose usage lacks one count spends the other alone (the missing count is
    no token), and the reservation is settled with it."""
    upstream = serve_app(scripted_chat_app(chat_reply("ok", usage=usage))) + "/v1"
    settings = Settings(upstream=upstream, db=migrated_sqlite(tmp_path / "t.db"),
                        data_dir=str(tmp_path / "data"), port=free_port(),
                        episode_max_tokens=1_000_000)
    proxy = Proxy(loop_thread, settings).start()
    try:
        body = {"model": "u", "messages": [QUESTION]}
        assert fetch("POST", proxy.episode_url("partial") + "/chat/completions", body)[0] == 200
        proxy.flush()
        proxy.loop.run(proxy.state.budgets.settled())
        spent = proxy.loop.run(budget_ledger.spent(proxy.state.engine, "partial"))
        assert (spent.tokens_used, spent.tokens_reserved) == (sum(usage.values()), 0)
    finally:
        proxy.stop()


def test_a_keyed_call_spends_from_its_episodes_own_budget(loop_thread, engine, tmp_path,
                                                          migrated_sqlite):
    """No default budgets: only a call that carries its episode's key is counted against
    the budget registered with it (kills the key not passed on to the budgets); the refusal
    is stored and counted."""
    settings = Settings(upstream=engine.url, db=migrated_sqlite(tmp_path / "t.db"),
                        data_dir=str(tmp_path / "data"), port=free_port())
    proxy = Proxy(loop_thread, settings).start()
    try:
        status, created = proxy.admin("POST", "/tracetap/episodes",
                                      {"id": "own", "budget": {"max_calls": 1}})
        assert status == 201
        body = {"model": "mock-model", "messages": [QUESTION]}
        url, key = created["base_url"] + "/chat/completions", created["api_key"]
        assert fetch("POST", url, body, token=key)[0] == 200
        status, refused = fetch("POST", url, body, token=key)
        assert status == 403 and b"over its calls budget (1 of 1)" in refused
        # The refusal is stored as such and counted by the limit it hit.
        [_, stored] = proxy.calls("own")
        assert (stored["status"], stored["http_status"]) == ("budget_exceeded", 403)
        assert proxy.state.metrics.budget_exceeded.labels("calls")._value.get() == 1
    finally:
        proxy.stop()
