"""/readyz answers 503 once the drain has started, for a load balancer still asking."""

from __future__ import annotations

from helpers.http import get


def _readyz(url: str) -> tuple[int, dict]:
    return get(url + "/readyz", timeout=10)


def test_readyz_says_not_ready_once_shutdown_begins(proxy):
    status, body = _readyz(proxy.url)
    assert (status, body["ready"], body["draining"]) == (200, True, False)
    # aiohttp's shutdown step (what SIGTERM runs after closing the listener, while calls
    # in flight finish); run here with the listener still open, so /readyz can be asked.
    proxy.loop.run(proxy.runner.app.shutdown())
    status, body = _readyz(proxy.url)
    assert (status, body["ready"], body["draining"]) == (503, False, True)
    assert all(u["healthy"] for u in body["upstreams"])  # not ready for the drain alone
