"""One model call, from the client's request to the stored record.

``ModelCall`` is the one driver of a call's life: nothing else changes its state. It
holds the call's parts, each with one job, and only it calls their changing methods:

- ``request`` (``proxy.call_request.CallRequest``): the request as the client sent it
  and as it goes upstream (validation, translation, repair, the API's additions);
- ``relay`` (``proxy.relay.Relay``): an event stream's reads parsed, captured,
  rewritten, held; ``capture`` (the API's reassembly) what was read;
- ``timings`` (``proxy.call_timings.Timings``): its moments, and every span read from
  them (the upstream's latency, the proxy's overhead);
- ``services`` (``proxy.call_services.CallServices``): the few parts of the running
  proxy a call uses, not the whole ``ProxyState``.

Its lifecycle, in the order a handler calls it:

- start: ``ModelCall(services, route, call_id)``, ``tag(episode_id)`` (arrival order),
  ``parse_request(body)`` (the body to send upstream; ``reroute`` for ``--translate
  auto``), ``await reserve(keyed, size)`` (the episode's budget), ``await admit()`` (the
  pause gate; stamps the policy version), ``sending()``;
- relay: ``replied(upstream_url, http_status)``, then either ``reply_body(body)`` for a
  whole reply, or ``relay_chunk(data)`` per read of an event stream and ``stream_end()``;
  each returns the bytes the client gets;
- finish: ``finish()`` in the handler's ``finally``, always; or, when the call ends
  early, ``fail(error, status)`` (refused before relaying: the client's error reply) or
  ``abort(status, error)`` (cut mid-relay) first.

An overlay that reviews the reply (``proxy.overlays.review``) drives the same call
through its API: ``under_overlay(log)``, ``model_view(messages, harness)`` (the model's
view of the request), ``await hold(reply, live)`` (the reply read and captured, held
back from the client), ``veto(reason)``, ``failed(error)``, ``resample()`` (the next
attempt: a new ModelCall on the same budget reservation) and ``release(out)`` (the held
or replaced end goes to the client).

Three rules live here and nowhere else: the record is journaled exactly once
(``journal``); it is journaled before the client is given the bytes that end the reply
(``end_reached``, which the relay and ``release`` call), so a call that completed for the
client is on disk even if the process dies next; and each attempt's tokens are spent
from the episode's budget exactly once (``_spend``; the first attempt's reservation is
settled with it). ``proxy.call_record.call_record`` builds the stored record,
``Metrics.observe_call`` the metrics; both only read. What differs between wire APIs
lives in ``api`` (the API spoken to the upstream) and ``translation`` (set when the client
speaks another API than the upstream: its request and replies are converted to and from
chat).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from tracetap.proxy.apis.chat.wire import decode_object, encode
from tracetap.proxy.budgets import Reservation, reservation_size
from tracetap.proxy.call_record import call_record
from tracetap.proxy.call_request import CallRequest
from tracetap.proxy.call_timings import Timings
from tracetap.proxy.errors import ProxyError
from tracetap.proxy.ids import uuid7
from tracetap.proxy.relay import Hold, HoldAll, Relay, broken_error
from tracetap.proxy.routing import Route
from tracetap.proxy.upstream import Reply, UpstreamBroken
from tracetap.proxy.versions import CallVersions

if TYPE_CHECKING:
    from tracetap.proxy.call_services import CallServices
    from tracetap.proxy.overlays.hooks import OverlayLog


class ModelCall:
    def __init__(self, services: CallServices, route: Route, call_id: str):
        self.services = services
        self.route = route
        self.api = route.api
        self.translation = route.translation  # a translate module, or None when native
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
        self.versions = CallVersions(services)  # the version of each token (proxy.versions)
        self.lineage: tuple[str | None, str | None] = (None, None)  # proxy.lineage.names
        self.upstream_url: str | None = None
        self.client_body: bytes | None = None  # a whole reply as the client got it
        self.reservation: Reservation | None = None  # what the episode's budget holds for it
        self.relay: Relay | None = None  # set by a stream's first read (or a hold)
        self._admitted = False
        self._journaled = False
        self._spent = False

    # -- start ----------------------------------------------------------------------
    def tag(self, episode_id: str | None,
            lineage: tuple[str | None, str | None] = (None, None)) -> None:
        """The call belongs to ``episode_id`` (and, inside it, to the conversation the
        lineage headers name, proxy.lineage): its arrival order."""
        self.episode_id = episode_id
        self.lineage = lineage
        self.seq = self.services.arrivals.next(episode_id)  # arrival order, not completion

    async def reserve(self, keyed: bool, body_bytes: int) -> None:
        """Hold the call's tokens in the episode's budget (raises BudgetExceeded); the
        request must be parsed (its completion cap decides how many)."""
        request = self.request
        size = reservation_size(request.client_payload or request.payload, body_bytes)
        self.reservation = await self.services.budgets.reserve(self.episode_id, size,
                                                               keyed=keyed)

    async def admit(self) -> None:
        """Wait at the pause gate (raises ProxyError when the pause outlasts its timeout)."""
        await self.services.gate.admit()
        self._admitted = True
        # Stamped after any pause: a call released by a resume runs on the new weights.
        self.policy_version = self.services.controls.policy_version
        self.versions.admit()  # token versions are judged from here

    async def rejoin(self) -> bool:
        """After a weight sync cut the call (proxy.continuation): wait for the resume,
        then run on the new version; False when the pause outlasted its timeout."""
        if not await self.services.gate.hold():
            return False
        self.policy_version = self.services.controls.policy_version
        self.versions.admit()
        return True

    # -- request side -----------------------------------------------------------
    def parse_request(self, body: bytes) -> bytes:
        """Validate the client's JSON and return the body to send upstream."""
        request = self.request = CallRequest(body)
        payload = request.decode()
        route = self.services.routing.for_request(self.route, payload)
        if route is not self.route:  # --translate auto: native would lose logprobs
            self._use(route)
        upstream = request.prepare(payload, self.route, self.services, self.episode_id)
        self.capture = self.api.capture(request.injected)
        return upstream

    def reroute(self, route: Route, body: bytes) -> bytes:
        """Speak another API to the upstream (the first answered 404): the client's
        request is prepared again from its original bytes."""
        self._use(route)
        return self.parse_request(body)

    def _use(self, route: Route) -> None:
        self.route = route
        self.api, self.translation, self.endpoint = route.api, route.translation, route.endpoint
        self.label = route.label

    @property
    def stream(self) -> bool:
        return self.request.stream

    @property
    def model(self) -> str | None:
        return self.request.model

    @property
    def experts(self):
        """The MoE routing asked for (proxy.experts, --routed-experts), or None."""
        return self.request.experts

    def arrived(self, data: bytes) -> None:
        """A captured event's tokens arrived now: their policy version, their routing."""
        self.versions.observe(_counts(self.capture))
        if self.request.experts is not None:
            self.request.experts.add(data)

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

    def overhead(self) -> float:
        """Seconds of the call so far that were not the upstream's."""
        return self.timings.overhead()

    def reply_body(self, body: bytes) -> bytes:
        """A whole reply: capture it, and return what the client should receive."""
        self.timings.upstream_done()
        self.timings.first_byte()
        if self.http_status != 200:
            if self.translation is not None:
                body = self.translation.error_from_chat(self.http_status, body)
            self.client_body = body
            return body
        self.capture.add(body)
        if self.experts is not None:
            self.experts.add(body)
        request = self.request
        if self.translation is not None:
            try:
                body = encode(self.translation.from_chat(decode_object(body),
                                                         request.client_payload))
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.error = "upstream reply is not JSON: relayed as it came"
        elif request.injected.any:
            try:
                body = self.api.strip_body(body, request.injected)
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass  # not the JSON we expected: the client gets it as it came
        self.client_body = body
        return body

    def relay_chunk(self, data: bytes) -> Iterable[bytes]:
        """One read of an event stream: the pieces to write to the client, in order.

        The record is journaled before the piece that ends the stream is given out, so
        the client never holds the end of a stream that is not on disk. A stream relayed
        as it came is captured after each piece is written (the pieces come from a
        generator); a rewritten one is captured as it is rewritten (``proxy.relay``)."""
        relay = self.relay
        if relay is None:
            relay = self.relay = Relay(self)
        if self.timings.t_first_byte is None:
            self.timings.first_byte()
        return relay.chunk(data)

    def stream_end(self) -> bytes:
        """The upstream closed the stream: what is left for the client (an unterminated
        last event, rewritten), possibly nothing."""
        self.timings.upstream_done()
        return b"" if self.relay is None else self.relay.end()

    def abort(self, status: str, error: str) -> None:
        """The relay was cut (upstream broke, client went away). A stream already
        journaled as complete keeps its record as it is."""
        self.timings.upstream_done()
        if not self._journaled:
            self.status, self.error = status, error

    # -- an overlay's review (proxy.overlays.review) ------------------------------------
    def under_overlay(self, log: OverlayLog) -> None:
        """The call runs under an overlay: its log is stored with the record."""
        self.overlay = log

    def model_view(self, messages: list[dict[str, Any]], harness: list[dict[str, Any]]) -> bytes:
        """The upstream body with the overlay's context in place of the harness's
        ``messages``; the model's view is stored beside the harness's when they differ."""
        return self.request.model_view(messages, harness)

    async def hold(self, reply: Reply, live: Hold | None = None) -> bytes:
        """Read the whole reply through the relay and capture it, holding back from the
        client all of it (or, with ``live``, what ``live`` holds: the rest goes out through
        ``live.write`` as it comes); returns the held bytes. The end is not journaled:
        ``release`` gives it out once the overlay has judged it. An upstream that breaks
        is recorded on the call and raised as a 502 ProxyError."""
        try:
            if not (self.stream and reply.content_type == "text/event-stream"):
                return self.reply_body(await reply.read())
            hold = HoldAll() if live is None else live
            self.relay = Relay(self, hold)
            async for data in reply.iter_chunks():
                for piece in self.relay_chunk(data):
                    await hold.write(piece)  # only what ``live`` lets through
            self.stream_end()
            return bytes(self.relay.held)
        except UpstreamBroken as exc:
            self.timings.upstream_done()
            self.status, self.error = "upstream_error", str(exc)
            raise broken_error(exc) from exc
        finally:
            reply.close()

    def veto(self, reason: str) -> None:
        """The overlay vetoed this attempt's reply: recorded as such, and journaled (a
        re-sample's tokens spent) before the next attempt is asked."""
        self.status = "vetoed"
        self.error = reason[:1000]
        self._attempt_over()

    def failed(self, error: ProxyError) -> None:
        """The upstream broke or the overlay failed closed during the review, after the
        client's stream began or on a re-sample (else the handler's ``fail`` records it)."""
        self.status = "upstream_error" if error.code == "upstream_error" else "overlay_failed"
        self.error = error.message
        if self.first_attempt is not None:  # a re-sample's record is complete now
            self.http_status = error.status
            self._attempt_over()

    def resample(self) -> ModelCall:
        """The next attempt: a new call record of the client's same request, in the same
        episode and budget reservation (its tokens are spent from it, not reserved
        again), stamped with the same policy version."""
        attempt = ModelCall(self.services, self.route, uuid7())
        first = self.first_attempt or self
        attempt.first_attempt = first
        attempt.tag(first.episode_id)
        attempt.policy_version = first.policy_version
        attempt.reservation = first.reservation
        attempt.parse_request(first.request.body or b"")
        return attempt

    def release(self, out: bytes) -> bytes:
        """The held (or replaced) reply goes to the client: journaled first."""
        self.end_reached()
        self._attempt_over()
        return out

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
            # The relay points back at its call: without this the pair is a cycle, and
            # the call's context-sized buffers (request, payload, first chunk) would wait
            # for the cyclic collector (50,000 allocations, serve._tune_gc) instead of
            # being freed now: at 60k context, 400+ fresh page faults a turn and 2x the RSS.
            self.relay.call = None
        asyncio.get_running_loop().call_soon(
            services.metrics.observe_call, self, self.timings.elapsed())

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
            self.services.submit(call_record(self))
            self.services.repair.remember(self)

    def _spend(self) -> None:
        """This attempt's tokens, from the episode's budget, exactly once. The first
        attempt settles its reservation with them (the rest is released); a re-sample
        spends from the same reservation, which its first attempt holds until it ends."""
        if self._spent:
            return
        self._spent = True
        prompt_tokens, completion_tokens = self.capture.tokens()
        used = (prompt_tokens or 0) + (completion_tokens or 0)
        if self.first_attempt is None:
            self.services.budgets.settle(self.reservation, used)
        else:
            self.services.budgets.spend(self.reservation, used)


def _counts(capture: Any) -> dict[int, int] | None:
    """Tokens per choice so far, where the reassembly can say (chat and completions)."""
    counts = getattr(capture, "token_counts", None)
    return None if counts is None else counts()
