"""One model call, from the client's request to the stored record.

``ModelCall`` owns the call's lifecycle and the rules of capture, so handlers only move
bytes. In the order a handler calls it:

- start: ``ModelCall(state, route, call_id)``, ``tag(episode_id)`` (arrival order, the
  episode's budget), ``parse_request(body)`` (the body to send upstream; ``reroute`` for
  ``--translate auto``), ``await admit()`` (the pause gate; stamps the policy version),
  ``sending()``;
- relay: ``replied(upstream_url, http_status)``, then either ``reply_body(body)`` for a
  whole reply, or ``relay_chunk(data)`` per read of an event stream and ``stream_end()``;
  each returns the bytes the client gets;
- finish: ``finish()`` in the handler's ``finally``, always; or, when the call ends
  early, ``fail(error, status)`` (refused before relaying: the client's error reply) or
  ``abort(status, error)`` (cut mid-relay) first.

Others read, and never set: ``episode_id``, ``stream``, ``model``, ``payload`` (the
request as sent upstream), ``status``, ``http_status``, ``capture`` (the reassembly);
``proxy.call_record.call_record`` builds the stored record, ``Metrics.observe_call`` the metrics.

Two rules live here and nowhere else: the record is journaled exactly once
(``journal``), and a stream's record is journaled before the client is given the
stream's end (``relay_chunk``), so a call that completed for the client is on disk even
if the process dies next. What differs between wire APIs lives in ``api`` (the API
spoken to the upstream) and ``translation`` (set when the client speaks another API
than the upstream: its request and replies are converted to and from chat).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Iterable, Iterator
from typing import Any

import msgspec
from aiohttp import web

from tracetap.proxy.apis import Injected
from tracetap.proxy.apis.chat import CHAT
from tracetap.proxy.apis.chat.reply import read_chunk_bytes
from tracetap.proxy.apis.chat.wire import decode_object, encode
from tracetap.proxy.apis.dropped import Dropped
from tracetap.proxy.budgets import Reservation, reservation_size
from tracetap.proxy.call_record import call_record
from tracetap.proxy.errors import ProxyError, bad_request
from tracetap.proxy.prompt_cut import KEY, cut_prompt_ids
from tracetap.proxy.routing import Route
from tracetap.proxy.sse import Event, SSEParser
from tracetap.proxy.state import ProxyState


class ModelCall:
    def __init__(self, state: ProxyState, route: Route, call_id: str):
        self.state = state
        self.route = route
        self.api = api = route.api
        self.translation = route.translation  # a translate module, or None when native
        self.endpoint = route.endpoint
        self.label = route.label  # the metrics route label
        self.call_id = call_id
        self.t_start = time.time()
        self.perf_start = time.perf_counter()
        self.episode_id: str | None = None
        self.seq: int | None = None
        self.request_body: bytes | None = None  # as the client sent it
        self.payload: dict[str, Any] = {}
        self.injected = Injected()
        self.capture = api.capture(self.injected)
        self.client_payload: dict[str, Any] = {}  # as the client sent it, when translated
        self.dropped = Dropped()  # what translation left out of the client's request
        self.upstream_request: bytes | None = None  # the engine's view, when not the client's
        self.repaired = False  # the model's own turns put back (proxy.repair)
        self.overlay = None  # proxy.overlays.hooks.OverlayLog, when an overlay runs
        self.stream_translator = None
        self.stream = False
        self.status = "ok"
        self.http_status = 0
        self.error: str | None = None
        self.policy_version: str | None = None
        self.upstream_url: str | None = None
        self.t_first_byte: float | None = None
        self.perf_upstream_start: float | None = None
        self.perf_upstream_end: float | None = None
        self.perf_first_content: float | None = None
        self.client_body: bytes | None = None
        self._admitted = False
        self.reservation: Reservation | None = None  # what the episode's budget holds for it
        self._parser: SSEParser | None = None  # set by a stream's first read
        self._rewrite = False  # its events are rewritten (else relayed as they come)
        self.done = False  # the upstream sent its end-of-stream marker
        self._journaled = False

    # -- start ----------------------------------------------------------------------
    def tag(self, episode_id: str | None) -> None:
        """The call belongs to ``episode_id``: its arrival order."""
        self.episode_id = episode_id
        self.seq = self.state.arrivals.next(episode_id)  # arrival order, not completion

    async def reserve(self, keyed: bool, body_bytes: int) -> None:
        """Hold the call's tokens in the episode's budget (raises BudgetExceeded); the
        request must be parsed (its completion cap decides how many)."""
        size = reservation_size(self.client_payload or self.payload, body_bytes)
        self.reservation = await self.state.budgets.reserve(self.episode_id, size, keyed=keyed)

    async def admit(self) -> None:
        """Wait at the pause gate (raises ProxyError when the pause outlasts its timeout)."""
        await self.state.gate.admit()
        self._admitted = True
        # Stamped after any pause: a call released by a resume runs on the new weights.
        self.policy_version = self.state.controls.policy_version

    # -- request side -----------------------------------------------------------
    def reroute(self, route: Route, body: bytes) -> bytes:
        """Speak another API to the upstream (the first answered 404): the client's
        request is prepared again from its original bytes."""
        self._use(route)
        return self.parse_request(body)

    def _use(self, route: Route) -> None:
        self.route = route
        self.api, self.translation, self.endpoint = route.api, route.translation, route.endpoint
        self.label = route.label

    def parse_request(self, body: bytes) -> bytes:
        """Validate the client's JSON and return the body to send upstream."""
        self.request_body = body  # kept as bytes: the handler holds them anyway
        try:
            payload = decode_object(body)
        except msgspec.DecodeError as exc:
            raise bad_request(f"request body is not valid JSON: {exc}", "invalid_json") from exc
        except msgspec.ValidationError as exc:
            raise bad_request("request body must be a JSON object", "invalid_json") from exc
        except RecursionError as exc:  # msgspec's own depth limit
            raise bad_request("request body nests JSON too deeply", "invalid_json") from exc
        self.stream = payload.get("stream") is True
        route = self.state.routing.for_request(self.route, payload)
        if route is not self.route:  # --translate auto: native would lose logprobs
            self._use(route)
        rewritten = self.state.model_map.apply(payload)
        if self.translation is not None:
            self.client_payload = payload
            self.dropped = Dropped()  # a reroute translates the request anew
            try:
                payload = self.translation.to_chat(payload, dropped=self.dropped,
                                                   flavor=self.state.flavor)
            except self.translation.Untranslatable as exc:
                raise self.translation.untranslatable(exc) from exc
            rewritten = True
            if self.stream:
                self.stream_translator = self.translation.StreamTranslator(self.client_payload)
        self.repaired = self.state.repair.apply(self.episode_id, self.api.endpoint, payload)
        self.payload = payload
        self.injected = self.api.prepare(payload, self.state.flavor)
        self.capture = self.api.capture(self.injected)
        if self.injected.any or rewritten or self.repaired:
            body = encode(payload)
        if self.translation is not None or self.repaired:
            self.upstream_request = body  # stored beside the client's request
        return body

    @property
    def relaying(self) -> bool:
        """Whether the client's stream has begun (its reply can no longer change)."""
        return self._parser is not None

    @property
    def request_text(self) -> str | None:
        """The client's request as text, decoded when read (the record), so a call in
        flight holds its prompt once as bytes rather than as bytes and text."""
        body = self.request_body
        return None if body is None else body.decode("utf-8", "replace")

    @property
    def rewrites_stream(self) -> bool:
        """Whether stream events must be parsed and rewritten (else relayed as they come)."""
        return self.injected.any or self.translation is not None or not self.api.ends_with_done

    @property
    def model(self) -> str | None:
        return _str(self.payload.get("model"))

    def fail(self, error: ProxyError, status: str) -> web.Response:
        """Refused before anything was relayed: the client's error reply."""
        self.status = status
        self.http_status = error.status
        self.error = error.message
        return error.response(self.route.errors)

    # -- relay ----------------------------------------------------------------------
    def sending(self) -> None:
        self.perf_upstream_start = time.perf_counter()

    def replied(self, upstream_url: str, http_status: int) -> None:
        """The upstream answered (its headers are in)."""
        self.upstream_url = upstream_url
        self.http_status = http_status

    def overhead(self) -> float:
        """Seconds of the call so far that were not the upstream's."""
        upstream = (self.perf_upstream_end or 0.0) - (self.perf_upstream_start or 0.0)
        return (time.perf_counter() - self.perf_start) - upstream

    def reply_body(self, body: bytes) -> bytes:
        """A whole reply: capture it, and return what the client should receive."""
        self.upstream_done()
        self.t_first_byte = time.time()
        if self.http_status != 200:
            if self.translation is not None:
                body = self.translation.error_from_chat(self.http_status, body)
            self.client_body = body
            return body
        self.capture.add(body)
        if self.translation is not None:
            try:
                body = encode(self.translation.from_chat(decode_object(body), self.client_payload))
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.error = "upstream reply is not JSON: relayed as it came"
        elif self.injected.any:
            try:
                body = self.api.strip_body(body, self.injected)
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass  # not the JSON we expected: the client gets it as it came
        self.client_body = body
        return body

    def relay_chunk(self, data: bytes) -> Iterable[bytes]:
        """One read of an event stream: the pieces to write to the client, in order.

        The record is journaled before the piece that ends the stream is given out, so
        the client never holds the end of a stream that is not on disk. A stream relayed
        as it came is captured after each piece is written (the pieces come from a
        generator); a rewritten one is captured as it is rewritten."""
        if self._parser is None:
            self.t_first_byte = time.time()
            self._parser = SSEParser()
            self._rewrite = self.rewrites_stream
        if self._rewrite:
            return self._rewritten(data)
        return self._as_received(data)

    def stream_end(self) -> bytes:
        """The upstream closed the stream: what is left for the client (an unterminated
        last event, rewritten), possibly nothing."""
        self.upstream_done()
        tail = None if self._parser is None else self._parser.flush()
        if tail is None:
            return b""
        out = self.on_event(tail)
        return out if self._rewrite else b""

    def abort(self, status: str, error: str) -> None:
        """The relay was cut (upstream broke, client went away). A stream already
        journaled as complete keeps its record as it is."""
        self.upstream_done()
        if not self._journaled:
            self.status, self.error = status, error

    def _as_received(self, data: bytes) -> Iterator[bytes]:
        """Nothing to remove: the upstream's bytes go out as they came, then capture
        reads them (off the client's time)."""
        parser = self._parser
        if b"[DONE]" not in parser.tail(6) + data:
            yield data
            for event in parser.feed(data):
                self.on_event(event)
            return
        # This read ends the stream.
        cut = max(data.find(b"data: [DONE]"), 0)
        if cut:
            yield data[:cut]
        for event in parser.feed(data):
            self.on_event(event)
        if self.done:
            self.journal()
        yield data[cut:]

    def _rewritten(self, data: bytes) -> list[bytes]:
        """Events rewritten to drop what the proxy added (or translated): one piece per
        read. A read that ends the stream is journaled before any of it is returned."""
        out = []
        for event in self._parser.feed(data):
            out.append(self.on_event(event))
            if self.done and not self._journaled:
                self.journal()  # as the end is seen: later events are not the call's
        return [b"".join(out)] if any(out) else []

    def on_event(self, event: Event) -> bytes:
        """One SSE event: capture it; return the bytes the client should get for it."""
        data = event.data
        translator = self.stream_translator
        if data is None:
            return event.raw if translator is None else b""
        if self.api.is_end(data):
            self.done = True
            self.upstream_done()
            if translator is not None:
                return b"".join(translator.finish())
            if data == b"[DONE]":
                return event.raw
        elif self.perf_first_content is None:
            self.perf_first_content = time.perf_counter()
        cut = None
        if len(data) > _CUT_ABOVE and KEY in data and getattr(self.capture, "endpoint", "") == CHAT:
            # The prompt's ids (vLLM's first chunk): kept as bytes, decoded at the end.
            cut = cut_prompt_ids(data)
        stripped = event  # what strip_event reads: without the ids the proxy asked for
        if cut is not None:
            data, prompt_ids = cut
            self.capture.add_prompt_ids(
                prompt_ids, functools.partial(self.state.prompt_prefixes.decode_packed,
                                          self.episode_id))
            if self.injected.token_ids:
                stripped = Event(event.raw, data)
        self.capture.add(data)
        if self.capture.ended and not self.done:  # a terminal event that carries data
            self.done = True
            self.upstream_done()
        if translator is not None:
            # The translator reads the whole chat chunk (usage too) and writes only the
            # client's API, so nothing the proxy asked for can reach the client.
            try:
                return b"".join(
                    translator.feed(read_chunk_bytes(data, logprobs=translator.wants_logprobs))
                )
            except (msgspec.DecodeError, msgspec.ValidationError):
                return b""  # capture noted the bad chunk; the client's stream stays valid
        if not self.injected.any:
            return event.raw
        try:
            return self.api.strip_event(stripped, self.injected)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return event.raw  # relayed as is; capture noted the bad chunk

    def upstream_done(self) -> None:
        if self.perf_upstream_end is None:
            self.perf_upstream_end = time.perf_counter()

    def first_byte(self) -> None:
        if self.t_first_byte is None:
            self.t_first_byte = time.time()

    # -- finish ---------------------------------------------------------------------
    def finish(self) -> None:
        """The call is over, however it ended: release the pause gate, journal the
        record (if the stream's end has not already), settle the episode's budget, and
        leave the metrics for after the reply is on its way."""
        state = self.state
        if self._admitted:
            self._admitted = False
            state.gate.release()
        self.journal()
        prompt_tokens, completion_tokens = self.capture.tokens()
        state.budgets.settle(self.reservation, (prompt_tokens or 0) + (completion_tokens or 0))
        asyncio.get_running_loop().call_soon(
            state.metrics.observe_call, self, time.perf_counter() - self.perf_start)

    def journal(self) -> None:
        """Journal the record, exactly once."""
        if not self._journaled:
            self._journaled = True
            self.state.submit(call_record(self))
            self.state.repair.remember(self)

# Below this a chunk's prompt ids are few enough to decode with the rest of it.
_CUT_ABOVE = 4096


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None
