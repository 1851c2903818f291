"""Who may open the viewer: the holder of the admin token, on the listener that serves it.

The browser logs in once with the admin token and gets a session cookie (HttpOnly,
SameSite=Strict). The cookie holds no secret: it is an issue time and a nonce signed with
HMAC keyed by the admin token, so nothing is stored on the server, a session lasts
SESSION_SECONDS, and changing the admin token ends every session. Scripts may send the
token as ``Authorization: Bearer``. An episode key (``tt-...``) is an agent's credential
and never opens the viewer.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from aiohttp import web

COOKIE = "tracetap_ui"
SESSION_SECONDS = 12 * 3600
EPISODE_KEY_PREFIX = "tt-"  # proxy.episodes.tagging.KEY_PREFIX; not imported: the viewer runs alone


class Access:
    """``token(request)``: the admin token in force; ``served_here(request)``: whether this
    listener serves the viewer (not the agent port when the admin API has its own)."""

    def __init__(self, token: Callable[[web.Request], str],
                 served_here: Callable[[web.Request], bool] | None = None):
        self.token = token
        self.served_here = served_here or (lambda _request: True)


def _mac(token: str, issued: int, nonce: str) -> str:
    message = f"tracetap-ui-session|{issued}|{nonce}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def new_session(token: str, now: float | None = None) -> str:
    issued = int(time.time() if now is None else now)
    nonce = secrets.token_urlsafe(12)
    return f"{issued}.{nonce}.{_mac(token, issued, nonce)}"


def valid_session(token: str, value: str, now: float | None = None) -> bool:
    parts = value.split(".")
    if len(parts) != 3 or not parts[0].isdigit():
        return False
    issued, nonce, mac = int(parts[0]), parts[1], parts[2]
    age = (time.time() if now is None else now) - issued
    if not 0 <= age <= SESSION_SECONDS:
        return False
    return hmac.compare_digest(mac, _mac(token, issued, nonce))


def token_matches(token: str, given: str) -> bool:
    return hmac.compare_digest(given.encode(), token.encode())


class Verdict:
    OK = "ok"
    LOGIN = "login"  # no credential, or an expired or wrong one
    EPISODE_KEY = "episode_key"


def verdict(request: web.Request, token: str) -> str:
    header = request.headers.get("Authorization", "")
    if header.startswith("Bearer "):
        given = header[7:].strip()
        if given.startswith(EPISODE_KEY_PREFIX):
            return Verdict.EPISODE_KEY
        return Verdict.OK if token_matches(token, given) else Verdict.LOGIN
    cookie = request.cookies.get(COOKIE)
    if cookie and valid_session(token, cookie):
        return Verdict.OK
    return Verdict.LOGIN


def same_origin(request: web.Request) -> bool:
    """A form post comes from this viewer's own pages (login CSRF, cross-site logout)."""
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None:  # every current browser sends it
        return site in ("same-origin", "none")
    origin = request.headers.get("Origin")
    if origin is None:
        return True  # not a browser form: a script with the token in hand
    return urlsplit(origin).netloc == request.host


def safe_next(value: str | None, prefix: str) -> str:
    """Where to go after logging in: a path inside the viewer, never another site."""
    if (value and value.startswith(prefix + "/") and "//" not in value and "\\" not in value
            and not any(ord(c) < 32 for c in value)):
        return value
    return prefix + "/"


def set_session(response: web.StreamResponse, request: web.Request, token: str,
                prefix: str) -> None:
    response.set_cookie(COOKIE, new_session(token), max_age=SESSION_SECONDS, path=prefix,
                        httponly=True, samesite="Strict", secure=request.secure)


def clear_session(response: web.StreamResponse, prefix: str) -> None:
    response.del_cookie(COOKIE, path=prefix)
