"""The API an overlay's review drives a model call through (``proxy.overlays.review``).

``ModelCall`` (``proxy.call.driver``) has these methods from ``CallReview``: they are its own
(only it changes its state), kept here so that the call's driver and lifecycle read
apart from what a reviewing overlay does to it. The overlay calls ``under_overlay(log)``,
``model_view(messages, harness)`` (the model's view of the request), ``await hold(reply,
live)`` (the reply read and captured, held back from the client), ``veto(reason)``,
``failed(error)``, ``resample()`` (the next attempt: a new ModelCall on the same budget
reservation) and ``release(out)`` (the held or replaced end goes to the client).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tracetap.proxy.call.relay import Hold, HoldAll, broken_error
from tracetap.proxy.episodes.ids import uuid7
from tracetap.proxy.upstream.client import Reply, UpstreamBroken

if TYPE_CHECKING:
    from tracetap.proxy.call.driver import ModelCall
    from tracetap.proxy.http.errors import ProxyError
    from tracetap.proxy.overlays.hooks import OverlayLog


class CallReview:
    """A reviewing overlay's view of ``ModelCall`` (a base class: its methods are the
    call's own and read and change only the call)."""

    def under_overlay(self: ModelCall, log: OverlayLog) -> None:
        """The call runs under an overlay: its log is stored with the record."""
        self.overlay = log

    def model_view(self: ModelCall, messages: list[dict[str, Any]],
                   harness: list[dict[str, Any]]) -> bytes:
        """The upstream body with the overlay's context in place of the harness's
        ``messages``; the model's view is stored beside the harness's when they differ."""
        return self.request.model_view(messages, harness)

    async def hold(self: ModelCall, reply: Reply, live: Hold | None = None) -> bytes:
        """Read the whole reply through the relay and capture it, holding back from the
        client all of it (or, with ``live``, what ``live`` holds: the rest goes out through
        ``live.write`` as it comes); returns the held bytes. The end is not journaled:
        ``release`` gives it out once the overlay has judged it. An upstream that breaks
        is recorded on the call and raised as a 502 ProxyError."""
        try:
            if not (self.stream and reply.content_type == "text/event-stream"):
                return self.reply_body(await reply.read())
            hold = HoldAll() if live is None else live
            relay = self.start_relay(hold)
            await relay.pump(reply.iter_chunks(), hold.write)  # only what ``live`` lets through
            return bytes(relay.held)
        except UpstreamBroken as exc:
            self.timings.upstream_done()
            self.status, self.error = "upstream_error", str(exc)
            raise broken_error(exc) from exc
        finally:
            reply.close()

    def veto(self: ModelCall, reason: str) -> None:
        """The overlay vetoed this attempt's reply: recorded as such, and journaled (a
        re-sample's tokens spent) before the next attempt is asked."""
        self.status = "vetoed"
        self.error = reason[:1000]
        self._attempt_over()

    def failed(self: ModelCall, error: ProxyError) -> None:
        """The upstream broke or the overlay failed closed during the review, after the
        client's stream began or on a re-sample (else the driver's ``fail`` records it)."""
        self.status = "upstream_error" if error.code == "upstream_error" else "overlay_failed"
        self.error = error.message
        if self.first_attempt is not None:  # a re-sample's record is complete now
            self.http_status = error.status
            self._attempt_over()

    def resample(self: ModelCall) -> ModelCall:
        """The next attempt: a new call record of the client's same request, in the same
        episode and budget reservation (its tokens are spent from it, not reserved
        again), stamped with the same policy version."""
        attempt = type(self)(self.services, self.route, uuid7())
        first = self.first_attempt or self
        attempt.first_attempt = first
        attempt.tag(first.episode_id)
        attempt.policy_version = first.policy_version
        attempt.reservation = first.reservation
        attempt.parse_request(first.request.body or b"")
        return attempt

    def release(self: ModelCall, out: bytes) -> bytes:
        """The held (or replaced) reply goes to the client: journaled first."""
        self.end_reached()
        self._attempt_over()
        return out
