"""Admin API under /tracetap/: episodes, rewards, policy version, health and metrics."""

from __future__ import annotations

import asyncio
import hmac
import math
import secrets
from typing import Any

import msgspec
from aiohttp import web
from sqlalchemy.exc import SQLAlchemyError

from tracetap.proxy.admin.finish_integrity import verdict_at_finish
from tracetap.proxy.apis.chat.errors import OPENAI_ERRORS
from tracetap.proxy.episodes.budgets import Budget
from tracetap.proxy.episodes.ids import uuid7
from tracetap.proxy.episodes.tagging import KEY_PREFIX, episode_path, hash_key, validate_episode_id
from tracetap.proxy.http.errors import ProxyError, bad_request, forbidden, not_found, unauthorized
from tracetap.proxy.http.headers import bearer
from tracetap.proxy.overlays.hooks import EpisodeInfo
from tracetap.proxy.runtime.keys import STATE
from tracetap.proxy.runtime.metrics import CONTENT_TYPE
from tracetap.storage import queries
from tracetap.storage.harness_configs import harness_configs as harness_config_rows


class Harness(msgspec.Struct, forbid_unknown_fields=True):
    name: str | None = None
    config: dict[str, Any] | None = None


class EpisodeCreate(msgspec.Struct, forbid_unknown_fields=True):
    id: str | None = None
    group_id: str | None = None
    task_id: str | None = None
    harness: Harness | None = None
    metadata: dict[str, Any] | None = None
    budget: Budget | None = None
    repair_history: bool | None = None  # None: the proxy's --repair-history
    overlay: str | None = None  # a loaded --overlay NAME; kept in metadata["overlay"] too
    parent: str | None = None  # the episode this one is a sub-agent of (a lineage's parent)
    # The models its calls may use (proxy.episodes.policy_models), kept in its metadata.
    policy_models: list[str] | None = None


class EpisodeFinish(msgspec.Struct, forbid_unknown_fields=True):
    reward: float | None = None
    rewards: dict[str, float] | None = None
    outcome: str | None = None
    info: dict[str, Any] | None = None


class PolicyUpdate(msgspec.Struct, forbid_unknown_fields=True):
    version: str


FINISH_GRACE = 2.0  # seconds; writers commit every 50 ms, a loaded database takes longer
_LIMITS = {"group_id": 128, "task_id": 256, "outcome": 256, "version": 128}


async def _decode(request: web.Request, kind: type):
    body = await request.read()
    try:
        value = msgspec.json.decode(body or b"{}", type=kind)
    except msgspec.ValidationError as exc:
        raise bad_request(f"invalid {kind.__name__}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", "invalid_json") from exc
    for field, limit in _LIMITS.items():
        text = getattr(value, field, None)
        if text is not None and len(text) > limit:
            raise bad_request(f"{field} is longer than {limit} characters")
    return value


def _require_admin(request: web.Request) -> None:
    state = request.app[STATE]
    if not serves_admin(request, state.settings):
        raise not_found(f"{request.method} {request.path} is not served on this port")
    given = bearer(request.headers) or ""
    if given.startswith(KEY_PREFIX):
        # An episode key is an agent's credential: it never opens the admin API.
        raise forbidden("episode API keys cannot use the admin API")
    if not hmac.compare_digest(given.encode(), state.admin_token.encode()):
        raise unauthorized("this endpoint needs the proxy's admin token (see --admin-token; "
                           "by default it is in DATA_DIR/admin-token)")


def serves_admin(request: web.Request, settings) -> bool:
    """Whether this listener serves admin routes: not the agent port when the admin API
    lives on a listener of its own (``--admin-port``, ``--admin-socket``)."""
    return not (settings.admin_listener and on_agent_port(request, settings.port))


def on_agent_port(request: web.Request, port: int) -> bool:
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    return isinstance(sockname, tuple) and sockname[1] == port


def _errors(handler):
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ProxyError as error:
            return error.response(OPENAI_ERRORS)  # the admin API answers in OpenAI's shape

    wrapped.__name__ = handler.__name__
    return wrapped


@_errors
async def create_episode(request: web.Request) -> web.Response:
    _require_admin(request)
    state = request.app[STATE]
    spec = await _decode(request, EpisodeCreate)
    episode_id = validate_episode_id(spec.id) if spec.id is not None else uuid7()
    if state.arrivals.served(episode_id):  # calls to it here, maybe not stored yet
        raise _has_calls(episode_id)
    if spec.group_id is not None:
        validate_episode_id(spec.group_id)
    if spec.parent is not None:
        validate_episode_id(spec.parent)
    api_key = KEY_PREFIX + secrets.token_urlsafe(32)
    key_hash = hash_key(api_key)
    harness = spec.harness or Harness()
    metadata = await _with_overlay(state, spec)
    limits = state.budgets.limits_for(spec.budget)
    try:
        await queries.create_episode(
            state.engine, episode_id=episode_id, key_hash=key_hash, group_id=spec.group_id,
            task_id=spec.task_id, harness_name=harness.name, harness_config=harness.config,
            metadata=metadata, budget=limits, parent_id=spec.parent,
        )
    except queries.EpisodeHasCalls as exc:
        raise _has_calls(episode_id) from exc
    except queries.EpisodeExists as exc:
        raise ProxyError(409, f"episode {episode_id!r} already exists", "invalid_request_error",
                         "episode_exists") from exc
    state.tagger.remember(episode_id, key_hash)
    state.budgets.registered(episode_id, limits)
    state.policy_models.register(episode_id, spec.policy_models)
    if spec.overlay is not None:
        state.overlays.register(EpisodeInfo(id=episode_id, task_id=spec.task_id,
                                            harness=harness.name, metadata=metadata or {}))
    if spec.repair_history is not None:
        state.repair.enable(episode_id, spec.repair_history)
    # The key rides in the base URL too, so a harness that only sets a base URL still
    # proves it holds the episode's key (an id alone cannot be guessed into one).
    base_url = f"{state.settings.base_url}/episodes/{episode_path(episode_id, api_key)}/v1"
    return web.json_response({"id": episode_id, "base_url": base_url, "api_key": api_key},
                             status=201)


def _has_calls(episode_id: str) -> ProxyError:
    # Calls sent to an id before it was registered came from whoever guessed it: a
    # registration never adopts them (register ids no one has used: unguessable ones).
    return ProxyError(409, f"episode {episode_id!r} already has calls: register an id no "
                      "call has used", "invalid_request_error", "episode_has_calls")


async def _with_overlay(state, spec: EpisodeCreate) -> dict[str, Any] | None:
    """The metadata to store: with ``"overlay"`` when the episode opts in (so tools that
    compare runs, such as ``tracetap compare``, can select by it), and its
    ``"policy_models"`` when registration names them."""
    given = (spec.metadata or {}).get("overlay")
    if given is not None and given != spec.overlay:
        raise bad_request('choose an overlay with "overlay", not metadata["overlay"]',
                          "overlay_in_metadata")
    if (spec.metadata or {}).get("policy_models") not in (None, spec.policy_models):
        raise bad_request('name policy models with "policy_models", not in metadata',
                          "policy_models_in_metadata")
    metadata = spec.metadata
    if spec.policy_models is not None:
        if not spec.policy_models or not all(0 < len(m) <= 256 for m in spec.policy_models):
            raise bad_request("policy_models is a list of 1-256 character model names")
        metadata = {**(metadata or {}), "policy_models": spec.policy_models}
    if spec.overlay is None:
        return metadata
    await state.overlays.check(spec.overlay)
    return {**(metadata or {}), "overlay": spec.overlay}


@_errors
async def finish_episode(request: web.Request) -> web.Response:
    # Rewards come from the operator's grader only: an episode's own key is the agent's
    # credential, and an agent that could finish its episode would grade itself.
    _require_admin(request)
    state = request.app[STATE]
    episode_id = validate_episode_id(request.match_info["episode"])
    spec = await _decode(request, EpisodeFinish)
    values = [spec.reward, *(spec.rewards or {}).values()]
    if any(v is not None and not math.isfinite(v) for v in values):
        raise bad_request("rewards must be finite numbers")
    # A finish may race the commit of the episode's last call. This process knows the
    # episodes it served calls for, so their row is created if it is not there yet; an
    # id it never saw gets FINISH_GRACE seconds for another replica's writer to commit.
    deadline = asyncio.get_running_loop().time() + FINISH_GRACE
    while not (found := await queries.finish_episode(
            state.engine, episode_id, reward=spec.reward, rewards=spec.rewards,
            outcome=spec.outcome, info=spec.info,
            create_missing=state.arrivals.served(episode_id))):
        if asyncio.get_running_loop().time() >= deadline:
            break
        await asyncio.sleep(0.1)  # polling the database for a row another process writes
    if not found:
        raise not_found(f"no episode {episode_id!r}: it was never registered and no call was "
                        "tagged with it (a typo?)")
    state.tagger.finished(episode_id)  # graded: its key takes no more calls (409)
    if found.changed:  # a retried finish with the same result changes nothing
        state.metrics.episode_finished(spec.reward)
        if (verdict := await verdict_at_finish(state, episode_id)) is not None:
            state.metrics.episode_integrity(verdict)
    state.prompt_prefixes.forget(episode_id)  # no call of it extends its prompt again
    return web.json_response({"id": episode_id, "finished": True, "changed": found.changed,
                              "finish_seq": found.finish_seq})


@_errors
async def get_episode(request: web.Request) -> web.Response:
    _require_admin(request)
    episode_id = validate_episode_id(request.match_info["episode"])
    episode = await queries.get_episode(request.app[STATE].engine, episode_id)
    if episode is None:
        raise not_found(f"no episode {episode_id!r}")
    return web.json_response(episode)


@_errors
async def list_episodes(request: web.Request) -> web.Response:
    _require_admin(request)
    query = request.query
    try:
        limit = min(max(int(query.get("limit", 100)), 1), 1000)
        offset = max(int(query.get("offset", 0)), 0)
    except ValueError as exc:
        raise bad_request("limit and offset must be integers") from exc
    finished = {"true": True, "false": False}.get(query.get("finished", "").lower())
    group = query.get("group_id")
    if group is not None:
        validate_episode_id(group)
    page = await queries.list_episodes(request.app[STATE].engine, limit=limit, offset=offset,
                                       group_id=group, finished=finished)
    return web.json_response(page)


@_errors
async def harness_configs(request: web.Request) -> web.Response:
    """The distinct (task, harness config) pairs a harness ran: ``tracetap run --space``
    builds on them (storage.harness_configs)."""
    _require_admin(request)
    harness = request.query.get("harness")
    if not harness:
        raise bad_request("harness (the harness name) is required")
    prefix = request.query.get("exclude_prefix") or None
    if prefix is not None and len(prefix) > 128:
        raise bad_request("exclude_prefix is longer than 128 characters")
    configs = await harness_config_rows(request.app[STATE].engine, harness,
                                        exclude_prefix=prefix)
    return web.json_response(configs)


@_errors
async def put_policy(request: web.Request) -> web.Response:
    """Stamp later calls of every process on the database with a policy version."""
    _require_admin(request)
    spec = await _decode(request, PolicyUpdate)
    if not spec.version:
        raise bad_request("version must not be empty")
    controls = request.app[STATE].controls
    await _stored(controls.set_policy(spec.version))
    return web.json_response({"version": spec.version})


@_errors
async def get_policy(request: web.Request) -> web.Response:
    _require_admin(request)
    return web.json_response({"version": request.app[STATE].controls.policy_version})


class Pause(msgspec.Struct, forbid_unknown_fields=True):
    wait: bool = True  # return once the calls in flight have finished
    timeout: float = 60.0
    # "drain": calls in flight finish; "abort": they are cut at the engine, held, and
    # continued after the resume (proxy.call.continuation), so a weight sync need not wait.
    mode: str = "drain"


class Resume(msgspec.Struct, forbid_unknown_fields=True):
    policy_version: str | None = None


@_errors
async def pause(request: web.Request) -> web.Response:
    """Hold new model calls in every process (for a weight sync); in-flight calls finish."""
    _require_admin(request)
    spec = await _decode(request, Pause)
    if spec.mode not in ("drain", "abort"):
        raise bad_request('mode must be "drain" or "abort"')
    state = request.app[STATE]
    serial = await _stored(state.controls.pause(abort=spec.mode == "abort"))
    drained = True
    if spec.wait:
        drained = await state.controls.drained(serial, max(0.0, spec.timeout))
    return web.json_response({"paused": True, "drained": drained,
                              "inflight": state.gate.inflight,
                              "policy_version": state.controls.policy_version})


@_errors
async def resume(request: web.Request) -> web.Response:
    """Stamp the new policy version, then release the held calls (in every process)."""
    _require_admin(request)
    spec = await _decode(request, Resume)
    if spec.policy_version is not None and not 0 < len(spec.policy_version) <= 128:
        raise bad_request("policy_version must be 1-128 characters")
    controls = request.app[STATE].controls
    await _stored(controls.resume(spec.policy_version))
    return web.json_response({"paused": False, "policy_version": controls.policy_version})


async def _stored(change):
    """An admin change is stored before it is answered; a database that refuses it is a
    503 (nothing was applied: the change is applied after it is stored)."""
    try:
        return await change
    except (SQLAlchemyError, OSError) as exc:
        reason = getattr(exc, "orig", None) or exc
        raise ProxyError(503, f"the change was not stored, the database refused it: {reason}",
                         "server_error", "database_unavailable",
                         headers={"Retry-After": "5"}) from exc


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready for model calls: an upstream answers and the process is not draining; the
    journal backlog is reported, the DB is not asked. The admin API's readiness is
    ``admin_readyz`` (``/readyz/admin``)."""
    state = request.app[STATE]
    await state.pool.check_health()
    upstreams = state.pool.describe()
    ready = any(u["healthy"] for u in upstreams) and not state.draining
    body = {
        "ready": ready,
        "draining": state.draining,
        "paused": state.gate.paused,
        "upstreams": upstreams,
        "journal": {"bytes": state.writer.journal.bytes, "pending_records": state.writer.pending},
        "database_writes_ok": state.writer.db_healthy,
    }
    return web.json_response(body, status=200 if ready else 503)


async def admin_readyz(request: web.Request) -> web.Response:
    """Ready for the admin API: the process serves and is not draining. Neither the engine
    nor the database is asked: registering, finishing, pausing and resuming go on while
    the engine is down (a weight sync restarts it), and a database outage is answered by
    each admin call with its own 503 in the API's shape, not by a load balancer's page."""
    state = request.app[STATE]
    ready = not state.draining
    body = {"ready": ready, "draining": state.draining, "paused": state.gate.paused,
            "database_writes_ok": state.writer.db_healthy}
    return web.json_response(body, status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    """Open to any scraper: everything but the families that grade episodes."""
    return _metrics(request, outcomes=False)


@_errors
async def admin_metrics(request: web.Request) -> web.Response:
    """Everything, rewards and integrity verdicts included: the admin's (proxy.runtime.metrics)."""
    _require_admin(request)
    return _metrics(request, outcomes=True)


def _metrics(request: web.Request, outcomes: bool) -> web.Response:
    state = request.app[STATE]
    state.metrics.refresh(state)
    return web.Response(body=state.metrics.render(outcomes),
                        headers={"Content-Type": CONTENT_TYPE})
