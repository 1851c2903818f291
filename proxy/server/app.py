"""The aiohttp application: routes, and the lifecycle of storage, writer and upstream."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os

from aiohttp import web

from tracetap.proxy.admin import annotations as admin_annotations
from tracetap.proxy.admin import api as admin
from tracetap.proxy.admin import overlays as admin_overlays
from tracetap.proxy.admin.ui import mount_viewer
from tracetap.proxy.call import handlers
from tracetap.proxy.episodes import tagging
from tracetap.proxy.overlays import patches
from tracetap.proxy.overlays.loader import load_overlays
from tracetap.proxy.runtime.keys import STATE
from tracetap.proxy.runtime.settings import Settings, Worker
from tracetap.proxy.runtime.state import ProxyState
from tracetap.proxy.server.compose import compose_state
from tracetap.proxy.upstream import flavor
from tracetap.storage import queries
from tracetap.storage.notify import EPISODES, FINISHED, PATCHES

log = logging.getLogger("tracetap")
SETTINGS = web.AppKey("settings", Settings)
OVERLAYS = web.AppKey("overlays", dict)
WORKER = web.AppKey("worker", Worker)
WORKER_HEADER = "X-Tracetap-Worker"
METRICS_REFRESH_SECONDS = 1.0


def build_app(settings: Settings, worker: Worker | None = None) -> web.Application:
    """The proxy; ``worker`` when it is one of ``serve --workers N`` processes."""
    app = web.Application(client_max_size=settings.max_body)
    app[SETTINGS] = settings
    app[OVERLAYS] = load_overlays(settings.overlay)  # the operator's code, imported at start
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_start_draining)
    if worker is not None:
        app[WORKER] = worker
        app.on_response_prepare.append(functools.partial(
            _identify, f"{worker.index}:{os.getpid()}"))
    r = app.router
    r.add_post("/tracetap/episodes", admin.create_episode)
    r.add_get("/tracetap/episodes", admin.list_episodes)
    r.add_get("/tracetap/episodes/{episode}", admin.get_episode)
    r.add_post("/tracetap/episodes/{episode}/finish", admin.finish_episode)
    r.add_get("/tracetap/harness-configs", admin.harness_configs)
    r.add_put("/tracetap/policy", admin.put_policy)
    r.add_get("/tracetap/policy", admin.get_policy)
    r.add_post("/tracetap/pause", admin.pause)
    r.add_post("/tracetap/resume", admin.resume)
    r.add_get("/tracetap/overlays", admin_overlays.list_overlays)
    r.add_get("/tracetap/overlays/{name}", admin_overlays.get_overlay)
    r.add_put("/tracetap/overlays/{name}", admin_overlays.put_overlay)
    r.add_delete("/tracetap/overlays/{name}", admin_overlays.delete_overlay)
    r.add_post("/tracetap/overlays/{name}/replay", admin_overlays.replay_overlay)
    r.add_post("/tracetap/annotations", admin_annotations.post_annotation)
    r.add_get("/tracetap/annotations", admin_annotations.list_annotations)
    r.add_get("/tracetap/metrics", admin.admin_metrics)
    r.add_get("/metrics", admin.metrics)
    r.add_get("/healthz", admin.healthz)
    r.add_get("/readyz", admin.readyz)  # the model API's readiness (the engine answers)
    r.add_get("/readyz/admin", admin.admin_readyz)  # the admin API's (never the engine)
    mount_viewer(app, settings)  # /tracetap/ui: before the agent routes' catch-all
    r.add_route("*", "/episodes/{episode}/v1/{tail:.*}", handlers.agent_request)
    r.add_route("*", "/episodes/{episode}", handlers.agent_request)
    r.add_route("*", "/episodes/{episode}/v1", handlers.agent_request)
    r.add_route("*", "/v1/{tail:.*}", handlers.agent_request)
    r.add_route("*", "/{tail:.*}", handlers.agent_request)
    return app


async def _start_draining(app: web.Application) -> None:
    """aiohttp's shutdown step: the listener is closed, in-flight calls still run."""
    if STATE in app:
        app[STATE].draining = True


async def _identify(value: str, request: web.Request, response: web.StreamResponse) -> None:
    """Which worker answered (index:pid), for tests and debugging."""
    response.headers[WORKER_HEADER] = value


async def _lifecycle(app: web.Application):
    settings = app[SETTINGS]
    worker = app.get(WORKER)
    state = await compose_state(settings, app[OVERLAYS], worker)
    log.info("exposed to agents: %s", state.exposure.describe())
    if app[OVERLAYS]:
        log.info("overlays loaded: %s (fail %s)", ", ".join(app[OVERLAYS]), settings.overlay_fail)
    app[STATE] = state
    # What the shared controls say (a pause, the policy version) holds from the first call.
    try:
        await state.controls.refresh()
    except Exception as exc:  # the database is down: serve, and follow it once it is back
        log.warning("cannot read the shared controls (pause, policy version) at start: %s", exc)
    await state.overlays.patches.refresh()  # a restarted proxy runs the stored patches
    state.writer.start()
    state.intents.start()
    background = await _background(state, worker is not None)
    try:
        yield
    finally:
        for task in background:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await _close(state)


async def _background(state: ProxyState, is_worker: bool) -> list[asyncio.Task]:
    """The tasks that run beside the calls, started (the flavor asked first, if auto)."""
    pool, settings = state.pool, state.settings
    notices = state.controls.notices
    # Registrations and finishes made elsewhere: read on their notice, or every
    # FOLLOW_SECONDS while no notices come (storage.notify).
    follow_wait, finished_wait = (
        functools.partial(notices.wait, topic, tagging.FOLLOW_SECONDS,
                          tagging.IDLE_FOLLOW_SECONDS) for topic in (EPISODES, FINISHED))
    background = [asyncio.create_task(notices.run()),
                  asyncio.create_task(_settle_previous(state)),
                  asyncio.create_task(state.controls.run()), asyncio.create_task(
        state.tagger.follow(functools.partial(queries.registered_since, state.engine),
                            wait=follow_wait)),
        asyncio.create_task(state.tagger.follow_finished(
            functools.partial(queries.finished_since, state.engine), wait=finished_wait)),
        asyncio.create_task(state.overlays.patches.follow(functools.partial(  # elsewhere
            notices.wait, PATCHES, patches.FOLLOW_SECONDS, patches.IDLE_FOLLOW_SECONDS)))]
    if is_worker:
        # Gauges mirrored from a worker's state are read from files by whichever worker is
        # scraped, so each worker keeps its own current.
        background.append(asyncio.create_task(_keep_refreshing(state)))
    if len(pool.targets) > 1:
        background.append(asyncio.create_task(pool.keep_checking()))
    if settings.upstream_flavor == "auto":
        # Engines behind one proxy are assumed to be of one kind: ask the first.
        found = await flavor.detect(pool.client, pool.primary)
        if found is not None:
            state.upstream_kind.found(found)
            log.info("upstream flavor: %s", found)
        else:
            background.append(asyncio.create_task(flavor.keep_detecting(
                pool.client, pool.primary, state.upstream_kind.found)))
    # After the flavor: which engines need their tokenizer found before calls arrive.
    background.append(asyncio.create_task(state.resolver.identify(
        [t.base_url for t in pool.targets])))
    return background


async def _settle_previous(state: ProxyState) -> None:
    """Once the journal a previous process left is written, the calls that process
    admitted and never journaled (streams its death cut) become tombstones, and this
    replica's lease may move (storage.intents)."""
    writer, intents = state.writer, state.intents
    while not (writer.replayed and writer.held == 0):
        await asyncio.sleep(0.2)  # polling the writer's replay, which runs on its own
    while True:
        try:
            stones = await intents.previous()
            break
        except Exception as exc:  # the database is down: the lease waits with it
            log.warning("cannot read the intents a previous process left: %s", exc)
            await asyncio.sleep(2)
    for stone in stones:
        state.submit(stone)
    if stones:
        log.warning("%d calls were cut when this replica's previous process stopped: "
                    "stored as tombstones (record_lost)", len(stones))
    intents.ready = True


async def _close(state: ProxyState) -> None:
    await state.controls.close()
    await state.overlays.patches.close()  # their worker processes
    await state.budgets.settled()  # what calls held is released before the DB closes
    await state.writer.close(timeout=state.settings.drain_timeout)
    # The lease closes only when everything this process took is stored.
    await state.intents.close(clean=state.writer.pending == 0 and state.intents.ready)
    await state.pool.client.close()
    try:
        await asyncio.wait_for(state.engine.dispose(), 10)
    except asyncio.TimeoutError:
        log.warning("database connections did not close in time")
    log.info("tracetap stopped; %d records left in the journal for the next start",
             state.writer.pending)


async def _keep_refreshing(state: ProxyState) -> None:
    while True:
        state.metrics.refresh(state)
        await asyncio.sleep(METRICS_REFRESH_SECONDS)
