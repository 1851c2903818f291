"""One way for the tests to speak HTTP: JSON requests that return (status, body) instead
of raising, the admin API (which remembers each registered episode's base URL, since a
registered episode takes calls only with its key), and episodes registered and finished.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

# Base URLs registration handed out, by (agent URL, episode id). Cleared after each test
# (servers._forget_base_urls): ports are reused by later tests.
BASE_URLS: dict[tuple[str, str], str] = {}


def fetch(method: str, url: str, body: Any = None, *, headers: dict | None = None,
          token: str | None = None, timeout: float = 30.0) -> tuple[int, bytes]:
    """One request; (status, the body's bytes). ``body`` is sent as is when it is bytes,
    else encoded as JSON. An error status is returned, not raised, and its connection
    closed at once (not at a later garbage collection, which would warn)."""
    headers = {"Content-Type": "application/json", **(headers or {})}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.read()


def request_json(method: str, url: str, body: Any = None, *, headers: dict | None = None,
                 token: str | None = None, timeout: float = 30.0) -> tuple[int, Any]:
    """``fetch``, with the body decoded as JSON (left as bytes when it is not JSON)."""
    status, raw = fetch(method, url, body, headers=headers, token=token, timeout=timeout)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def post(url: str, body: Any, headers: dict | None = None, *,
         timeout: float = 30.0) -> tuple[int, Any]:
    return request_json("POST", url, body, headers=headers, timeout=timeout)


def get(url: str, *, timeout: float = 30.0) -> tuple[int, Any]:
    return request_json("GET", url, timeout=timeout)


def get_page(url: str, token: str | None = None,
             accept: str = "text/html") -> tuple[int, dict[str, str], str]:
    """A GET as a browser makes it, without following redirects (the viewer's login
    redirect is the answer under test): (status, headers, body text)."""
    headers = {"Accept": accept}
    if token:
        headers["Authorization"] = f"Bearer {token}"

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=30) as reply:
            return reply.status, dict(reply.headers), reply.read().decode()
    except urllib.error.HTTPError as err:
        with err:  # its connection closes now, not at some later garbage collection
            return err.code, dict(err.headers), err.read().decode()


def metrics_text(url: str, timeout: float = 10.0) -> str:
    """The proxy's ``/metrics`` page at base URL ``url``."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as reply:
        return reply.read().decode()


def admin_metrics_text(url: str, token: str, timeout: float = 10.0) -> str:
    """The admin's ``/tracetap/metrics`` page (the episode outcome families included)."""
    status, page = fetch("GET", url + "/tracetap/metrics", token=token, timeout=timeout)
    assert status == 200, page
    return page.decode()


def admin_call(url: str, method: str, path: str, body=None,
               token: str | None = None) -> tuple[int, dict]:
    """One admin API request; returns (status, decoded JSON body) without raising."""
    status, reply = request_json(method, url + path, body, token=token)
    if method == "POST" and path == "/tracetap/episodes" and status == 201:
        prefix, _, _ = reply["base_url"].partition("/episodes/")
        BASE_URLS[(prefix, reply["id"])] = reply["base_url"]
    return status, reply


def episode_url(agent_url: str, episode_id: str) -> str:
    """The base URL an agent of this episode uses: the registered one, else the plain
    path-tagged one."""
    return BASE_URLS.get((agent_url, episode_id), f"{agent_url}/episodes/{episode_id}/v1")


def episode_headers(agent_url: str, episode_id: str) -> dict[str, str]:
    """Headers that tag a call with an episode: its id, and its key when registered."""
    headers = {"X-Tracetap-Episode": episode_id}
    base_url = BASE_URLS.get((agent_url, episode_id))
    if base_url is not None:
        secret = base_url.rsplit("/", 2)[-2].partition("~")[2]
        headers["Authorization"] = f"Bearer tt-{secret}"
    return headers


def register(proxy, episode: str, **spec) -> dict:
    """Register ``episode`` with ``spec`` (group, task_id, harness, overlay...) on a
    proxy (in-process or subprocess); it must be created. Returns the admin API's reply
    (``base_url``, ``api_key``)."""
    status, reply = proxy.admin("POST", "/tracetap/episodes", {"id": episode, **spec})
    assert status == 201, reply
    return reply


def finish(proxy, episode: str, reward: float = 1.0, **fields) -> None:
    """Finish ``episode`` with ``reward`` and any other fields (outcome, rewards)."""
    status, reply = proxy.admin("POST", f"/tracetap/episodes/{episode}/finish",
                                {"reward": reward, **fields})
    assert status == 200, reply


def wait_ready(url: str, process=None, timeout: float = 30.0, what: str = "the server") -> None:
    """Poll ``url`` (a readiness or health page) until it answers 200; fail at once if
    ``process`` (a ``subprocess.Popen`` serving it) has exited, or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"{what} exited with status {process.returncode}")
        try:
            if fetch("GET", url, timeout=1)[0] == 200:
                return
        except OSError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not answer {url} within {timeout} s")
        time.sleep(0.05)  # polling for readiness, not waiting for a result
