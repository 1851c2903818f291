"""Admin API for overlays: list them, install a runtime patch, read one, delete one.

``PUT /tracetap/overlays/NAME`` takes a patch's Python source (the body as text, or JSON
``{"source": ...}``), loads it in a confined worker process and stores it; episodes then
name it as their ``overlay``, without a restart (docs/overlays.md, docs/admin-api.md).
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from tracetap.proxy.admin.api import _errors, _require_admin
from tracetap.proxy.episodes.tagging import validate_episode_id
from tracetap.proxy.http.errors import ProxyError, bad_request, not_found
from tracetap.proxy.overlays.hooks import EpisodeInfo
from tracetap.proxy.overlays.patches import MAX_SOURCE, PatchRefused
from tracetap.proxy.overlays.replay import replay
from tracetap.proxy.overlays.workers import WorkerRefused
from tracetap.proxy.runtime.keys import STATE
from tracetap.storage import queries


class PatchBody(msgspec.Struct, forbid_unknown_fields=True):
    source: str


class ReplayBody(msgspec.Struct, forbid_unknown_fields=True):
    episode: str  # whose recorded calls the hooks run on
    budget: float = 2.0  # seconds per hook


async def _source(request: web.Request) -> str:
    body = await request.read()
    if len(body) > 4 * MAX_SOURCE:
        raise bad_request(
            f"the patch is {len(body)} bytes; at most {MAX_SOURCE} characters", "overlay_too_large"
        )
    if request.content_type == "application/json":
        try:
            return msgspec.json.decode(body, type=PatchBody).source
        except msgspec.ValidationError as exc:
            raise bad_request(f'a JSON body is {{"source": "..."}}: {exc}') from exc
        except msgspec.DecodeError as exc:
            raise bad_request(f"request body is not valid JSON: {exc}", "invalid_json") from exc
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the patch is not UTF-8 text: {exc}") from exc


@_errors
async def put_overlay(request: web.Request) -> web.Response:
    _require_admin(request)
    patches = request.app[STATE].overlays.patches
    source = await _source(request)
    try:
        described, new = await patches.install(request.match_info["name"], source)
    except PatchRefused as refused:
        raise ProxyError(
            refused.status, str(refused), "invalid_request_error", refused.code
        ) from refused
    return web.json_response(described, status=201 if new else 200)


@_errors
async def list_overlays(request: web.Request) -> web.Response:
    _require_admin(request)
    overlays = request.app[STATE].overlays
    started = [{"name": name, "kind": "start"} for name in sorted(overlays.loaded)]
    return web.json_response({"overlays": started + await overlays.patches.listed()})


@_errors
async def get_overlay(request: web.Request) -> web.Response:
    _require_admin(request)
    overlays = request.app[STATE].overlays
    name = request.match_info["name"]
    if name in overlays.loaded:
        return web.json_response({"name": name, "kind": "start"})
    found = await overlays.patches.described(name)
    if found is None:
        raise not_found(f"no overlay {name!r}")
    return web.json_response(found)


@_errors
async def delete_overlay(request: web.Request) -> web.Response:
    _require_admin(request)
    overlays = request.app[STATE].overlays
    name = request.match_info["name"]
    if name in overlays.loaded:
        raise bad_request(
            f"overlay {name!r} is loaded at start (--overlay): it is not deleted through the API",
            "overlay_loaded_at_start",
        )
    if not await overlays.patches.remove(name):
        raise not_found(f"no overlay {name!r}")
    return web.json_response({"name": name, "deleted": True})


@_errors
async def replay_overlay(request: web.Request) -> web.Response:
    """The patch's hooks on an episode's recorded calls: ``{ok, why, hooks, calls}``."""
    _require_admin(request)
    state = request.app[STATE]
    name = request.match_info["name"]
    try:
        spec = msgspec.json.decode(await request.read(), type=ReplayBody)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise bad_request(f'the body is {{"episode": ID, "budget"?: SECONDS}}: {exc}') from exc
    if not 0 < spec.budget <= 60:
        raise bad_request("budget is more than 0 and at most 60 seconds")
    episode_id = validate_episode_id(spec.episode)
    found = await state.overlays.patches.described(name)
    if found is None:
        raise not_found(f"no patch {name!r} (only installed patches are replayed)")
    registered = await queries.episode_registration(state.engine, episode_id)
    if registered is None:
        raise not_found(f"no episode {episode_id!r}")
    info = EpisodeInfo(
        id=episode_id,
        task_id=registered.get("task_id"),
        harness=(registered.get("harness") or {}).get("name"),
        metadata=registered.get("metadata") or {},
    )
    calls = await queries.calls_of(state.engine, episode_id)
    worker = state.overlays.patches.worker(name, found["source"])
    try:
        why, hooks = await replay(worker, info, calls, spec.budget)
    except WorkerRefused as refused:
        raise ProxyError(503, str(refused), "invalid_request_error", refused.code) from refused
    return web.json_response({"ok": why is None, "why": why, "hooks": hooks, "calls": len(calls)})
