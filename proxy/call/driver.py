"""One model call, from the client's request to the stored record.

``ModelCall`` is the one driver of a call's life: the handler hands it the request once
(``ModelCall.run``), and nothing else changes its state. Its parts, each with one job:
``request`` (``call.request``: the request as the client sent it and as it goes
upstream), ``relay`` (``call.relay``: a stream's reads parsed, captured, rewritten, held),
``capture`` (the API's reassembly), ``timings`` (``call.timings``), and ``services``
(``call.services``: the parts of the proxy a call uses; the driver alone is given the
front besides: tagger, body limits, overlays, pool).

``run`` takes the steps in order, within ``--call-deadline`` (``call.deadline``): ``tag``
(arrival order), ``parse_request`` (the body to send upstream; ``reroute`` after
``--translate auto``'s 404), ``reserve`` (the episode's budget), the overlay's session,
``admit`` (the pause gate; the policy version), the send (with ``call.continuation``'s
weight-sync wrappers), ``replied``, the relay (``reply_body``, or the stream handed to
``Relay.pump`` once), and ``finish`` always, after ``fail`` (refused before relaying) or
``abort`` (cut mid-relay). A reviewing overlay drives the attempts through
``CallReview``'s methods (``call.review``), which are ModelCall's own.

Three rules live here and nowhere else: the record is journaled exactly once
(``journal``), and before the client is given the bytes that end the reply
(``end_reached``, which the relay and ``release`` call), so a call that completed for the
client is on disk even if the process dies next; each attempt's tokens are spent from the
episode's budget exactly once (``_spend``). ``call.record`` builds the stored record and
the metrics' values. What differs between wire APIs lives in ``api`` (spoken upstream)
and ``translation`` (set when the client speaks another API: converted to and from chat).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web

from tracetap.proxy.apis.routing import Route
from tracetap.proxy.call import continuation, deadline
from tracetap.proxy.call.record import call_outcome, journaled
from tracetap.proxy.call.relay import Hold, Relay, broken_error, whole_reply
from tracetap.proxy.call.request import CallRequest
from tracetap.proxy.call.review import CallReview
from tracetap.proxy.call.timings import Timings
from tracetap.proxy.episodes import lineage
from tracetap.proxy.episodes.budgets import BudgetExceeded, Reservation, charged
from tracetap.proxy.episodes.ids import uuid7
from tracetap.proxy.http.bodies import read_body
from tracetap.proxy.http.errors import STORED_STATUS, ProxyError
from tracetap.proxy.http.exposure import upstream_path
from tracetap.proxy.http.headers import OVERHEAD_HEADER, response_headers, upstream_request_headers
from tracetap.proxy.overlays.review import review
from tracetap.proxy.policy.versions import CallVersions
from tracetap.proxy.upstream.client import Reply, UpstreamBroken

if TYPE_CHECKING:
    from tracetap.proxy.call.services import CallFront, CallServices
    from tracetap.proxy.overlays.hooks import OverlayLog


class ModelCall(CallReview):
    def __init__(self, services: CallServices, route: Route, call_id: str):
        self.services = services
        self.route = route
        self.api = route.api
        self.translation = route.translation  # a Translation, or None when native
        self.endpoint = route.endpoint
        self.label = route.label  # the metrics route label
        self.call_id = call_id
        self.timings = Timings()
        self.episode_id: str | None = None
        self.seq: int | None = None
        self.request = CallRequest()
        self.capture = route.api.capture(self.request.injected)
        self.overlay: OverlayLog | None = None  # when an overlay runs
        self.first_attempt: ModelCall | None = None  # set on a re-sample: the harness's call
        self.status = "ok"
        self.http_status = 0
        self.error: str | None = None
        self.policy_version: str | None = None
        self.versions = CallVersions(services)  # the version of each token (proxy.policy.versions)
        self.lineage: tuple[str | None, str | None] = (None, None)  # proxy.episodes.lineage.names
        self.upstream_url: str | None = None
        self.client_body: bytes | None = None  # a whole reply as the client got it
        self.reservation: Reservation | None = None  # what the episode's budget holds for it
        self.relay: Relay | None = None  # set as a stream's relay starts (or a hold's)
        self._admitted = self._journaled = self._spent = False

    # -- the driver -------------------------------------------------------------------
    @classmethod
    async def run(cls, front: CallFront, route: Route, request: web.Request,
                  path: str) -> web.StreamResponse:
        """A captured request's whole life, entered once by the handler (``front`` is the
        running proxy, ``ProxyState``): tag → parse → reserve → overlay session → admit →
        send → relay → finish. Never a bare 500: a refusal is the client's error reply, a
        bug an internal error, or, once the client's stream has begun, the stream cut."""
        return await cls(front, route, uuid7())._run(front, request, path)

    async def _run(self, front: CallFront, request: web.Request,
                   path: str) -> web.StreamResponse:
        metrics = self.services.metrics
        metrics.inflight.inc()
        try:
            try:
                async with (limit := deadline.Deadline(self, request, front.settings)):
                    return await self._drive(request, path, front)
                return limit.response  # past the deadline before the reply began
            except BudgetExceeded as error:
                metrics.child(metrics.budget_exceeded, error.limit).inc()
                return self.fail(error, "budget_exceeded")
            except ProxyError as error:
                metrics.count_refusal(error.code)
                return self.fail(error, STORED_STATUS.get(error.code, "bad_request"))
            except Exception as exc:  # a bug, or input nothing above foresaw
                error = front.failures.internal(exc, self.call_id)
                if self.relaying:  # the client's stream has begun: it cannot become an error
                    self.abort("error", error.message)
                    raise
                return self.fail(error, "error")
            except asyncio.CancelledError:  # the proxy stopping under the call
                if not self.relaying:  # else the relay has said how the stream ended
                    self.abort("proxy_stopped", "cancelled before the reply was sent")
                raise
        finally:
            metrics.inflight.dec()
            self.finish()
            await self.services.intents.wait(self.call_id)  # stored before the answer ends

    async def _drive(self, request: web.Request, path: str,
                     front: CallFront) -> web.StreamResponse:
        settings = front.settings
        tagged = await front.tagger.resolve(request.headers, request.match_info.get("episode"))
        self.tag(tagged.episode_id, lineage.names(request.headers))
        body = await read_body(request, settings.max_body, settings.body_timeout)
        upstream_body = self.parse_request(body)  # --translate auto may change the route
        self.request.other_model = await front.policy_models.other(  # or refused
            self.episode_id, self.request.model)
        await self.reserve(tagged.keyed, len(body))
        overlay = await front.overlays.session(self, request.headers)  # docs/overlays.md
        if overlay is not None:
            upstream_body = await overlay.prepare(self, upstream_body)
        await self.admit()
        headers = upstream_request_headers(
            request.headers, api_key=settings.upstream_api_key,
            forward_client_auth=settings.forward_client_auth, identity=True)
        query = request.rel_url.raw_query_string
        self.sending()

        def send(attempt: ModelCall, b: bytes):  # the attempt's route as it is when called
            target = path if attempt.translation is None else attempt.api.path
            # A body awaited when a weight sync cuts it is sent again (not the agent's fault)
            return continuation.cuttable(attempt, functools.partial(
                front.pool.send, "POST", upstream_path(target, query), headers, b,
                episode_id=attempt.episode_id, model=attempt.request.model))

        if overlay is not None and overlay.reviews_reply(self):
            return await review(overlay, request, self, send, upstream_body)
        target, reply = await send(self, upstream_body)
        fallback = front.routing.fallback(self.route) if reply.status == 404 else None
        if fallback is not None:
            # --translate auto: the upstream lacks this API, so speak chat to it.
            reply.close()
            upstream_body = self.reroute(fallback, body)
            if overlay is not None:  # chat-shaped now: the hooks run as when translated
                upstream_body = await overlay.prepare(self, upstream_body)
                if overlay.reviews_reply(self):
                    return await review(overlay, request, self, send, upstream_body)
            target, reply = await send(self, upstream_body)
        self.replied(target.base_url, reply.status)
        if self.stream and reply.content_type == "text/event-stream":
            # A weight sync in abort mode cuts the stream; it is continued, not lost.
            reads = continuation.stream(self, reply, front.pool, headers)
            return await self._relay_stream(request, reply, reads)

        async def again():  # a body cut by a weight sync is sent again
            return (await send(self, upstream_body))[1]

        return await self._relay_body(reply, settings.overhead_header, again)

    async def _relay_stream(self, request: web.Request, reply: Reply,
                            reads: AsyncGenerator[bytes, None]) -> web.StreamResponse:
        """The event stream to the client as it comes, through the relay (one hand-over);
        a cut on either side ends the call as cut."""
        response = web.StreamResponse(status=reply.status,
                                      headers=response_headers(reply.headers.items()))
        try:
            await response.prepare(request)
            write = self.services.intents.before_end(self, response.write)  # intent first
            tail = await self.start_relay().pump(reads, write)
            if tail:
                await response.write(tail)
            await response.write_eof()
        except UpstreamBroken as exc:
            self.abort("upstream_error", str(exc))
            # End the client's stream the way the upstream ended ours: abruptly.
            if request.transport is not None:
                request.transport.abort()
        except ConnectionResetError:
            self.abort("client_disconnected", "client went away mid-stream")
        except asyncio.CancelledError:  # aiohttp cancels no handler for a client gone
            self.abort("proxy_stopped", "the proxy stopped mid-stream")
            raise
        finally:
            # Closed now: left mid-way, they would hold their cut in the gate till collected.
            await reads.aclose()
            if not reply.closed:  # read to its end, it closed itself
                reply.close()
        return response

    async def _relay_body(self, reply: Reply, overhead_header: bool,
                          again: Callable[[], Awaitable[Reply]]) -> web.Response:
        """A whole reply: read (sent again if a weight sync cut it), captured, rewritten."""
        try:
            reply = await continuation.whole(self, reply, again)
            body = await reply.read()
        except UpstreamBroken as exc:
            raise broken_error(exc) from exc
        finally:
            if not reply.closed:  # read, it closed itself
                reply.close()
        response = web.Response(status=reply.status, body=self.reply_body(body),
                                headers=response_headers(reply.headers.items()))
        if overhead_header:
            response.headers[OVERHEAD_HEADER] = f"{self.timings.overhead() * 1000:.3f}"
        return response

    # -- start ----------------------------------------------------------------------
    def tag(self, episode_id: str | None,
            lineage: tuple[str | None, str | None] = (None, None)) -> None:
        """The call belongs to ``episode_id`` (and, inside it, to the conversation the
        lineage headers name, proxy.episodes.lineage): its arrival order."""
        self.episode_id = episode_id
        self.lineage = lineage
        self.seq = self.services.arrivals.next(episode_id)  # arrival order, not completion
        self.services.intents.admit(self.call_id, episode_id)  # told the database, off-path

    async def reserve(self, keyed: bool, body_bytes: int) -> None:
        """Hold the call's tokens in the episode's budget (raises BudgetExceeded)."""
        payload = self.request.client_payload or self.request.payload
        self.reservation = await self.services.budgets.reserve_call(
            self.episode_id, self.endpoint, payload, body_bytes, keyed=keyed)

    async def admit(self) -> None:
        """Wait at the pause gate (raises ProxyError when the pause outlasts its timeout)."""
        await self.services.gate.admit()
        self._admitted = True
        # Stamped after any pause: a call released by a resume runs on the new weights.
        self.policy_version = self.services.controls.policy_version
        self.versions.admit()  # token versions are judged from here

    async def rejoin(self) -> bool:
        """After a weight sync cut the call: wait for the resume, run on the new version
        (False: the pause outlasted its timeout)."""
        if not await self.services.gate.hold():
            return False
        self.policy_version = self.services.controls.policy_version
        self.versions.admit()
        return True

    # -- request side -----------------------------------------------------------
    def parse_request(self, body: bytes) -> bytes:
        """Validate the client's JSON and return the body to send upstream."""
        route, upstream = self.request.parse(body, self.route, self.services, self.episode_id)
        if route is not self.route:  # --translate auto: native would lose logprobs
            self._use(route)
        self.capture = self.api.capture(self.request.injected)
        return upstream

    def reroute(self, route: Route, body: bytes) -> bytes:
        """Speak another API to the upstream (it answered 404): the request prepared again."""
        self._use(route)
        self.request = CallRequest()
        return self.parse_request(body)

    def _use(self, route: Route) -> None:
        self.route, self.api, self.translation = route, route.api, route.translation
        self.endpoint, self.label = route.endpoint, route.label

    @property
    def stream(self) -> bool:
        return self.request.stream

    @property
    def model(self) -> str | None:
        return self.request.model

    @property
    def relaying(self) -> bool:
        """Whether the client's stream has begun (its reply can no longer change)."""
        return self.relay is not None and self.relay.hold is None

    @property
    def rewrites_stream(self) -> bool:
        """Whether stream events must be parsed and rewritten (else relayed as they come)."""
        return (self.request.injected.any or self.translation is not None
                or not self.api.ends_with_done)

    @property
    def done(self) -> bool:
        """The upstream's stream has reached its end marker."""
        return self.relay is not None and self.relay.done

    def fail(self, error: ProxyError, status: str) -> web.Response:
        """Refused before anything was relayed: the client's error reply."""
        self.status = status
        self.http_status = error.status
        self.error = error.message
        return error.response(self.route.errors)

    # -- relay ----------------------------------------------------------------------
    def sending(self) -> None:
        self.timings.sending()

    def replied(self, upstream_url: str, http_status: int) -> None:
        """The upstream answered (its headers are in)."""
        self.upstream_url = upstream_url
        self.http_status = http_status

    def reply_body(self, body: bytes) -> bytes:
        """A whole reply: capture it, and return what the client should receive."""
        self.timings.upstream_done()
        self.timings.first_byte()
        if self.http_status != 200:
            if self.translation is not None:
                body = self.translation.error_from_chat(self.http_status, body)
        else:
            body, error = whole_reply(self, body)
            if error is not None:
                self.error = error
        self.client_body = body
        return body

    def start_relay(self, hold: Hold | None = None) -> Relay:
        """The relay of an event stream (or of one held for an overlay's review): it is
        handed the whole stream once (``Relay.pump``)."""
        relay = self.relay = Relay(self, self.rewrites_stream, hold)
        return relay

    def abort(self, status: str, error: str) -> None:
        """The relay was cut (upstream broke, client went away). A stream already
        journaled as complete keeps its record as it is."""
        self.timings.upstream_done()
        if not self._journaled:
            self.status, self.error = status, error

    # -- finish ---------------------------------------------------------------------
    def end_reached(self) -> None:
        """The bytes that end the client's reply go out next: the record is journaled
        first (the relay calls this as it sees a stream's end; ``release`` for a held
        reply; a whole reply is journaled by ``finish``, before aiohttp writes it)."""
        self.journal()

    def finish(self) -> None:
        """The call is over, however it ended: release the pause gate, journal the
        record (if the stream's end has not already), settle the episode's budget, and
        leave the metrics for after the reply is on its way."""
        services = self.services
        if self._admitted:
            self._admitted = False
            services.gate.release()
        self.journal()
        self._spend()
        if self.relay is not None:
            # The relay points back at its call: a cycle, whose context-sized buffers (request,
            # payload, first chunk) would wait for the cyclic collector (serve._tune_gc), not
            # be freed now: at 60k context, 400+ fresh page faults a turn and 2x the RSS.
            self.relay.call = None
        # After the reply: bookkeeping, whose own failure never reaches the client.
        outcome = functools.partial(call_outcome, self, self.timings.elapsed())
        asyncio.get_running_loop().call_soon(lambda: services.metrics.observe_call(outcome()))

    def _attempt_over(self) -> None:
        """This attempt's record is final: journaled, and a re-sample's tokens spent (the
        first attempt's are settled by ``finish``, which releases its reservation only
        when the call ends: its re-samples spend from it until then)."""
        self.journal()
        if self.first_attempt is not None:
            self._spend()

    def journal(self) -> None:
        """Journal the record, exactly once."""
        if not self._journaled:
            self._journaled = True
            self.services.submit(*journaled(self))
            ok = self.status == "ok" and self.http_status == 200
            self.services.repair.remember(self.episode_id, self.api.speaks_chat, ok, self.capture)

    def _spend(self) -> None:
        """This attempt's tokens, from the episode's budget, exactly once. The first
        attempt settles its reservation with them (the rest is released); a re-sample
        spends from the same reservation, which its first attempt holds until it ends."""
        if self._spent:
            return
        self._spent = True
        used = charged(self.capture, self.reservation)  # usage, else the tokens seen
        if self.first_attempt is None:
            self.services.budgets.settle(self.reservation, used)
        else:
            self.services.budgets.spend(self.reservation, used)

