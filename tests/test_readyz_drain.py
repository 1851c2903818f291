"""/readyz (the model API) and /readyz/admin (the admin API) answer 503 once the drain has
started, for a load balancer still asking; only /readyz depends on the engine."""

from __future__ import annotations

from helpers.http import get


def _readyz(url: str, scope: str = "") -> tuple[int, dict]:
    return get(url + "/readyz" + scope, timeout=10)


def test_readyz_says_not_ready_once_shutdown_begins(proxy):
    status, body = _readyz(proxy.url)
    assert (status, body["ready"], body["draining"]) == (200, True, False)
    assert _readyz(proxy.url, "/admin")[0] == 200
    # aiohttp's shutdown step (what SIGTERM runs after closing the listener, while calls
    # in flight finish); run here with the listener still open, so /readyz can be asked.
    proxy.loop.run(proxy.runner.app.shutdown())
    status, body = _readyz(proxy.url)
    assert (status, body["ready"], body["draining"]) == (503, False, True)
    assert all(u["healthy"] for u in body["upstreams"])  # not ready for the drain alone
    status, body = _readyz(proxy.url, "/admin")
    assert (status, body["ready"], body["draining"]) == (503, False, True)


def test_an_engine_that_is_down_leaves_the_admin_api_ready(proxy, engine, loop_thread):
    loop_thread.run(engine.close())
    status, body = _readyz(proxy.url)
    assert (status, body["ready"]) == (503, False)
    assert not any(u["healthy"] for u in body["upstreams"])
    status, body = _readyz(proxy.url, "/admin")
    assert (status, body["ready"], body["draining"]) == (200, True, False)
    # The admin API itself answers meanwhile.
    assert proxy.admin("POST", "/tracetap/episodes", {"id": "engine-down"})[0] == 201
