"""HTTP handlers for agent traffic: the path checked and routed; a captured call handed to
its driver (``ModelCall.run``: tag → forward → relay → hand the record off), anything
else exposed relayed untouched."""

from __future__ import annotations

import time

from aiohttp import web

from tracetap.proxy.apis.routing import Route, client_errors
from tracetap.proxy.call.driver import ModelCall
from tracetap.proxy.episodes.ids import uuid7
from tracetap.proxy.http.bodies import read_body
from tracetap.proxy.http.errors import ErrorShape, ProxyError
from tracetap.proxy.http.exposure import checked_path, refused, upstream_path
from tracetap.proxy.http.headers import (
    response_headers,
    upstream_request_headers,
)
from tracetap.proxy.runtime.keys import STATE
from tracetap.proxy.upstream.client import UpstreamBroken
from tracetap.storage.records import CallRecord

_BASE_PATHS = ("", "/", "/v1", "/v1/")


async def agent_request(request: web.Request) -> web.StreamResponse:
    """Every agent request: the model API is captured or relayed, all else refused."""
    state = request.app[STATE]
    try:
        path = _api_path(request, checked_path(request.raw_path))
        route = state.routing.route(path, state.flavor) if request.method == "POST" else None
        if route is not None:
            return await model_call(request, route, path)
        if request.method in ("GET", "HEAD") and path in _BASE_PATHS:
            # Harnesses probe their base URL (Anthropic's CLI sends HEAD first): answered
            # here, so the episode id in the path never reaches the upstream.
            return web.json_response({"status": "ok", "service": "tracetap"})
        if not state.exposure.allows(request.method, path):
            state.metrics.child(state.metrics.refused, "not_exposed").inc()
            raise refused(request.method, path)
    except ProxyError as error:
        if error.code == "invalid_path":
            state.metrics.child(state.metrics.refused, "invalid_path").inc()
        return error.response(_errors(request))
    return await passthrough(request, path, _errors(request))


def _errors(request: web.Request) -> ErrorShape:
    """The error shape of a request that is not captured (a captured call's is its
    route's): decided from the path as it came, so a path refused as invalid gets it too."""
    return client_errors(_api_path(request), request.headers)


def _api_path(request: web.Request, checked: str | None = None) -> str:
    """The path as the upstream API knows it, without the episode prefix: from the
    checked path (``exposure.checked_path``) once there is one."""
    info = request.match_info
    if checked is not None:
        if "episode" not in info:
            return checked
        return "/" + checked.removeprefix("/episodes/").partition("/")[2]  # "/episodes/e": "/"
    if "episode" not in info:
        return request.path
    # Unchecked, the path only picks the error shape: /episodes/{id} and /episodes/{id}/v1
    # name no API (OpenAI's shape, as for "/").
    return "/v1/" + info["tail"] if "tail" in info else "/"


async def model_call(request: web.Request, route: Route, path: str) -> web.StreamResponse:
    """A captured path: the request handed once to its call's driver (``ModelCall.run``)."""
    return await ModelCall.run(request.app[STATE], route, request, path)


async def passthrough(request: web.Request, path: str, errors: ErrorShape) -> web.StreamResponse:
    """An exposed path that is not captured (models, tokenize, --allow-path): the body
    read under the same limit as model calls, the reply relayed untouched as it streams."""
    state = request.app[STATE]
    headers = upstream_request_headers(
        request.headers,
        api_key=state.settings.upstream_api_key,
        forward_client_auth=state.settings.forward_client_auth,
        identity=False,
    )
    t_start = time.time()
    try:
        episode_id = await state.tagger.episode_for(
            request.headers, request.match_info.get("episode"), model_call=False)
    except ProxyError as error:  # the same checks as a model call's, so nothing is stored
        state.metrics.count_refusal(error.code)
        return error.response(errors)
    code = "499"
    try:
        try:
            body = await read_body(request, state.settings.max_body, state.settings.body_timeout)
            _, reply = await state.pool.send(
                request.method,
                _with_query(path, request),
                headers,
                body if request.body_exists else None,
                episode_id=episode_id,
            )
        except ProxyError as error:
            code = str(error.status)
            return error.response(errors)
        response = web.StreamResponse(
            status=reply.status, headers=response_headers(reply.headers.items())
        )
        try:
            await response.prepare(request)
            async for data in reply.iter_chunks():
                await response.write(data)
            await response.write_eof()
            code = str(reply.status)
        except UpstreamBroken:
            code = "502"
            if request.transport is not None:
                request.transport.abort()
        finally:
            reply.close()
        return response
    finally:
        state.metrics.requests.labels("passthrough", code).inc()
        if episode_id is not None and request.method == "POST":
            # Not captured, but the episode shows that the call happened, and what came back.
            state.submit(
                CallRecord(
                    call_id=uuid7(),
                    episode_id=episode_id,
                    seq=state.arrivals.next(episode_id),
                    instance=state.instance,
                    endpoint=path[:32],
                    status="passthrough",
                    http_status=0 if code == "499" else int(code),
                    t_start=t_start,
                    t_end=time.time(),
                )
            )


def _with_query(path: str, request: web.Request) -> str:
    """The upstream's path and query: the checked path, encoded once (exposure.py)."""
    return upstream_path(path, request.rel_url.raw_query_string)
