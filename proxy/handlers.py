"""HTTP handlers for agent traffic: tag → forward → relay → hand the record off."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from tracetap.proxy import continuation, lineage
from tracetap.proxy.bodies import read_body
from tracetap.proxy.budgets import BudgetExceeded
from tracetap.proxy.capture import ModelCall
from tracetap.proxy.errors import ErrorShape, ProxyError
from tracetap.proxy.exposure import checked_path, refused, upstream_path
from tracetap.proxy.headers import (
    OVERHEAD_HEADER,
    response_headers,
    upstream_request_headers,
)
from tracetap.proxy.ids import uuid7
from tracetap.proxy.keys import STATE
from tracetap.proxy.overlays.review import review
from tracetap.proxy.relay import broken_error
from tracetap.proxy.routing import Route, client_errors
from tracetap.proxy.upstream import Reply, UpstreamBroken
from tracetap.storage.records import CallRecord

_STATUS_BY_CODE = {
    "upstream_timeout": "upstream_timeout",
    "upstream_unreachable": "upstream_unreachable",
    "upstream_error": "upstream_error",
    "paused": "paused",
    "overlay_failed": "overlay_failed",
    "episode_budget_exceeded": "budget_exceeded",
    "episode_budget_reserved": "budget_exceeded",
}


# Refusals counted in tracetap_agent_refused_total{reason}, by their error code.
_COUNTED_REFUSALS = frozenset({"episode_credential_required", "forbidden", "invalid_api_key"})

_BASE_PATHS = ("", "/", "/v1", "/v1/")


async def agent_request(request: web.Request) -> web.StreamResponse:
    """Every agent request: the model API is captured or relayed, all else refused."""
    state = request.app[STATE]
    errors = client_errors(_api_path(request), request.headers)  # a route's, when it has one
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
        return error.response(errors)
    return await passthrough(request, path, errors)


def _api_path(request: web.Request, checked: str | None = None) -> str:
    """The path as the upstream API knows it, without the episode prefix: from the
    checked path (``exposure.checked_path``) once there is one."""
    info = request.match_info
    if checked is not None:
        if "episode" not in info:
            return checked
        rest = checked.removeprefix("/episodes/").partition("/")[2]
        return "/" + rest if rest else ""
    if "episode" not in info:
        return request.path
    if "tail" in info:
        return "/v1/" + info["tail"]
    return "/v1" if request.path.endswith("/v1") else ""


async def model_call(request: web.Request, route: Route, path: str) -> web.StreamResponse:
    state = request.app[STATE]
    metrics = state.metrics
    call = ModelCall(state, route, uuid7())
    metrics.inflight.inc()
    try:
        try:
            tagged = await state.tagger.resolve(request.headers,
                                                request.match_info.get("episode"))
            call.tag(tagged.episode_id, lineage.names(request.headers))
            body = await read_body(request, state.settings.max_body,
                                   state.settings.body_timeout)
            upstream_body = call.parse_request(body)
            route = call.route  # --translate auto may pick another route for this request
            await call.reserve(tagged.keyed, len(body))
            overlay = await state.overlays.session(call, request.headers)  # docs/overlays.md
            if overlay is not None:
                upstream_body = await overlay.prepare(call, upstream_body)
            await call.admit()
            headers = upstream_request_headers(
                request.headers,
                api_key=state.settings.upstream_api_key,
                forward_client_auth=state.settings.forward_client_auth,
                identity=True,
            )
            call.sending()

            def send(attempt: ModelCall, b: bytes):  # the route as it is when called
                # issue 27 hook: a body awaited when a weight sync cuts it is sent again
                return continuation.cuttable(
                    attempt, lambda: _send(request, attempt, route, path, headers, b))

            if overlay is not None and overlay.reviews_reply(call):
                return await review(overlay, request, call, send, upstream_body)
            target, reply = await send(call, upstream_body)
            fallback = state.routing.fallback(route) if reply.status == 404 else None
            if fallback is not None:
                # --translate auto: the upstream lacks this API, so speak chat to it.
                reply.close()
                route = fallback
                upstream_body = call.reroute(route, body)
                if overlay is not None:  # chat-shaped now: the hooks run as when translated
                    upstream_body = await overlay.prepare(call, upstream_body)
                    if overlay.reviews_reply(call):
                        return await review(overlay, request, call, send, upstream_body)
                target, reply = await send(call, upstream_body)
            call.replied(target.base_url, reply.status)
            if call.stream and reply.content_type == "text/event-stream":
                # issue 27 hook: a weight sync in abort mode continues the stream
                return await _relay_stream(request, reply, call,
                                           continuation.sender(state, call, headers))

            async def again():  # issue 27 hook: a body cut by a weight sync is sent again
                return (await send(call, upstream_body))[1]

            return await _relay_body(reply, call, state.settings.overhead_header, again)
        except BudgetExceeded as error:
            metrics.child(metrics.budget_exceeded, error.limit).inc()
            return call.fail(error, "budget_exceeded")
        except ProxyError as error:
            count_refusal(metrics, error)
            return call.fail(error, _STATUS_BY_CODE.get(error.code, "bad_request"))
        except Exception as exc:  # a bug, or input nothing above foresaw: never a bare 500
            error = state.failures.internal(exc, call.call_id)
            if call.relaying:  # the client's stream has begun: it cannot become an error
                call.abort("error", error.message)
                raise
            return call.fail(error, "error")
    finally:
        metrics.inflight.dec()
        call.finish()


async def _send(
    request: web.Request,
    call: ModelCall,
    route: Route,
    path: str,
    headers: dict[str, str],
    body: bytes,
):
    upstream_path = path if route.translation is None else route.api.path
    return await request.app[STATE].pool.send(
        "POST",
        _with_query(upstream_path, request),
        headers,
        body,
        episode_id=call.episode_id,
        model=call.model,
    )


async def _relay_body(reply: Reply, call: ModelCall, overhead_header: bool,
                      again=None) -> web.StreamResponse:
    try:
        if again is not None:
            reply = await continuation.whole(call, reply, again)  # issue 27 hook
        body = await reply.read()
    except UpstreamBroken as exc:
        raise broken_error(exc) from exc
    finally:
        reply.close()
    response = web.Response(
        status=reply.status,
        body=call.reply_body(body),
        headers=response_headers(reply.headers.items()),
    )
    if overhead_header:
        response.headers[OVERHEAD_HEADER] = f"{call.overhead() * 1000:.3f}"
    return response


async def _relay_stream(request: web.Request, reply: Reply, call: ModelCall,
                        send=None) -> web.StreamResponse:
    response = web.StreamResponse(
        status=reply.status, headers=response_headers(reply.headers.items())
    )
    try:
        await response.prepare(request)
        chunks = reply.iter_chunks() if send is None else continuation.stream(call, reply, send)
        async for data in chunks:  # issue 27 hook: continued after a weight sync
            for piece in call.relay_chunk(data):
                await response.write(piece)
        tail = call.stream_end()
        if tail:
            await response.write(tail)
        await response.write_eof()
    except UpstreamBroken as exc:
        call.abort("upstream_error", str(exc))
        # End the client's stream the way the upstream ended ours: abruptly.
        if request.transport is not None:
            request.transport.abort()
    except (ConnectionResetError, asyncio.CancelledError) as exc:
        call.abort("client_disconnected", "client went away mid-stream")
        if isinstance(exc, asyncio.CancelledError):
            raise
    finally:
        reply.close()
    return response


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
        count_refusal(state.metrics, error)
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


def count_refusal(metrics, error: ProxyError) -> None:
    """Attempts on someone else's episode are counted (the agent is untrusted)."""
    if error.code in _COUNTED_REFUSALS:
        metrics.child(metrics.refused, error.code).inc()


def _with_query(path: str, request: web.Request) -> str:
    """The upstream's path and query: the checked path, encoded once (exposure.py)."""
    return upstream_path(path, request.rel_url.raw_query_string)
