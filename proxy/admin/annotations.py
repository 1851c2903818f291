"""Admin API for annotations: ``POST /tracetap/annotations`` stores a label, a comment or a
corrected reward on an episode, a call or a token span; ``GET /tracetap/annotations``
lists an episode's (``?episode=ID``) or a call's (``?call=ID``). The admin token only: an
agent's episode key is refused, so a policy never reads or writes its own labels.
Checks and limits are storage.annotations' (docs/admin-api.md).
"""

from __future__ import annotations

import msgspec
from aiohttp import web
from sqlalchemy.exc import SQLAlchemyError

from tracetap.proxy.admin.api import _errors, _require_admin, _stored
from tracetap.proxy.episodes.tagging import validate_episode_id
from tracetap.proxy.http.errors import ProxyError, bad_request
from tracetap.proxy.runtime.keys import STATE
from tracetap.storage import annotations
from tracetap.storage.annotations import MAX_AUTHOR, NewAnnotation, Refused

MAX_BODY = 16 * 1024  # bytes: a comment's 4,000 characters, escaped, and the rest
_CODES = {400: "invalid_annotation", 404: "not_found", 409: "too_many_annotations"}


class AdminAnnotation(NewAnnotation, kw_only=True, forbid_unknown_fields=True):
    author: str | None = None  # who, as the caller names them; kept as "api: NAME"


def _author(given: str | None) -> str:
    if given is None or not given.strip():
        return "admin token"
    name = given.strip()
    if len(name) > MAX_AUTHOR - 5 or not name.isprintable():
        raise bad_request(f"author is one printable line of at most {MAX_AUTHOR - 5} "
                          "characters")
    return "api: " + name


@_errors
async def post_annotation(request: web.Request) -> web.Response:
    _require_admin(request)
    body = await request.content.read(MAX_BODY + 1)
    if len(body) > MAX_BODY:
        raise ProxyError(413, f"an annotation's body is at most {MAX_BODY} bytes",
                         "invalid_request_error", "body_too_large")
    try:
        given = msgspec.json.decode(body or b"{}", type=AdminAnnotation)
    except msgspec.ValidationError as exc:
        raise bad_request(f"invalid annotation: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", "invalid_json") from exc
    if given.episode is not None:
        validate_episode_id(given.episode)
    author = _author(given.author)
    fields = {f: getattr(given, f) for f in NewAnnotation.__struct_fields__}
    try:
        stored = await _stored(annotations.add(request.app[STATE].engine,
                                               NewAnnotation(**fields), author=author,
                                               source="api"))
    except Refused as refused:
        raise ProxyError(refused.status, str(refused), "invalid_request_error",
                         _CODES.get(refused.status, "invalid_annotation")) from refused
    return web.json_response(_out(stored), status=201)


@_errors
async def list_annotations(request: web.Request) -> web.Response:
    _require_admin(request)
    engine = request.app[STATE].engine
    episode, call = request.query.get("episode"), request.query.get("call")
    if (episode is None) == (call is None):
        raise bad_request("name ?episode=ID or ?call=ID (one of them)")
    if episode is not None:
        read = annotations.of_episodes(engine, [validate_episode_id(episode)])
    else:
        if len(call) > 64:
            raise bad_request("call is longer than 64 characters")
        read = annotations.of_call(engine, call)
    try:
        found = await read
    except (SQLAlchemyError, OSError) as exc:
        raise ProxyError(503, f"the database could not be read: {getattr(exc, 'orig', exc)}",
                         "server_error", "database_unavailable",
                         headers={"Retry-After": "5"}) from exc
    return web.json_response({"annotations": [_out(a) for a in found]})


def _out(stored: annotations.Stored) -> dict:
    return {**msgspec.to_builtins(stored), "target": stored.target}
