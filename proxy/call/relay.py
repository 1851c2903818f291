"""An event stream's way from the upstream to the client, for one call.

``Relay.chunk`` is the one place each upstream read of a stream is handled (parsed into
SSE events, captured, rewritten for the client, held or given out); ``Relay.event`` the
one place each event is. Three ways out, one code path:

- relayed as it came (the client asked for everything tracetap would add): the read goes
  out, then capture reads it, off the client's time;
- rewritten (what tracetap added is stripped, or the reply translated to the client's
  API): captured and rewritten event by event;
- held for an overlay's ``after_model`` (``hold``): rewritten, but kept back, all of it or
  (``Hold.held``) from the first tool call on, until the overlay has judged the reply.

Seams: a feature that acts per upstream read (stopping or continuing a stream when the
weights change; which policy version produced the tokens that arrived, ``_observe``: a
read's tokens arrived at one instant) belongs in ``Relay.chunk``; one that notes
something per event (the experts' routing) in ``Relay.event``, beside ``capture.add``;
what it stores goes into the record in one place, ``proxy.call.record.call_record``.

The relay is given the call's parts it works on (the reassembly, the timings, the
version spans, the experts' routing) and never calls back into the call per read or per
event: the call's driver (``ModelCall.run``) hands it the whole stream once
(``Relay.pump``). Only where the client is about to get the bytes that end the stream
does the relay ask the call to journal first (``ModelCall.end_reached``, once); a held
stream's end goes out through ``ModelCall.release`` instead, after the overlay's verdict
is on the record.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from tracetap.proxy.apis.chat.capture import DONE
from tracetap.proxy.apis.chat.prompt_cut import KEY, cut_prompt_ids
from tracetap.proxy.apis.chat.reply import read_chunk_bytes
from tracetap.proxy.apis.chat.wire import decode_object, encode
from tracetap.proxy.http.errors import ProxyError
from tracetap.proxy.http.sse import Event, SSEParser
from tracetap.proxy.upstream.client import UpstreamBroken

if TYPE_CHECKING:
    from tracetap.proxy.call.driver import ModelCall

# Below this a chunk's prompt ids are few enough to decode with the rest of it.
_CUT_ABOVE = 4096


class Hold(Protocol):
    """Which events of a held stream wait for the overlay; the rest go out live."""

    def held(self, event: Event, translator: Any) -> bool:
        """Whether ``event`` is held (read before it is captured; ``translator`` is the
        client stream's, as it is before the event)."""

    def sent(self, event: Event) -> None:
        """``event`` was given to the client as it came."""

    async def write(self, piece: bytes) -> None:
        """Give ``piece`` (events not held) to the client."""


class HoldAll:
    """Everything waits (``after_model`` sees the whole reply)."""

    def held(self, event: Event, translator: Any) -> bool:
        return True

    def sent(self, event: Event) -> None:  # pragma: no cover - nothing is sent
        pass

    async def write(self, piece: bytes) -> None:  # pragma: no cover - nothing is sent
        pass


class Relay:
    """One call's event stream: its parser, its client-side translator, what is held."""

    __slots__ = ("api", "call", "capture", "done", "experts", "first_out", "held", "hold",
                 "injected", "one_step", "parser", "rewrite", "step", "strip", "timings",
                 "token_counts", "translator", "versions")

    def __init__(self, call: ModelCall, rewrite: bool, hold: Hold | None = None) -> None:
        self.call = call
        self.parser = SSEParser()
        self.hold = hold
        self.rewrite = rewrite or hold is not None  # else relayed as it came
        self.held = bytearray()  # a held stream's bytes for the client, not yet given
        # The call's parts an event touches, read once (the request is parsed by now).
        self.api, self.capture, self.timings = call.api, call.capture, call.timings
        self.injected = call.request.injected
        self.strip = self.injected.any  # something the proxy added is in every event
        self.versions = call.versions  # the policy version of each token (proxy.policy.versions)
        self.experts = call.request.experts  # the MoE routing asked for, or None
        # Tokens per choice so far, where the reassembly can say (chat and completions).
        self.token_counts = getattr(self.capture, "token_counts", _no_counts)
        translation = call.translation
        self.translator = (  # the client's API written from chat chunks
            translation.StreamTranslator(call.request.client_payload)
            if translation is not None and call.request.stream else None
        )
        # Capture and strip as one step, where the API has one for this stream (chat).
        make_step = getattr(self.api, "event_step", None)
        self.step = (make_step(self.capture, self.injected)
                     if make_step is not None and self.strip and self.translator is None
                     and self.experts is None else None)
        # A read of one token chunk of such a stream, given out as it comes (the usual
        # read of a paced engine's stream) goes through ``_one``: one call, not three.
        self.one_step = self.step is not None and hold is None
        self.done = False  # the upstream sent its end-of-stream marker
        self.first_out = False  # a read after the stream's first token: one piece

    async def pump(self, reads: AsyncIterable[bytes],
                   write: Callable[[bytes], Awaitable[object]]) -> bytes:
        """Every read of the upstream's stream, its pieces given to ``write`` (the
        client's response, or a hold's) as they come; returns what is left once the
        upstream closed it (``end``)."""
        chunk = self.chunk
        async for data in reads:
            for piece in chunk(data):
                await write(piece)
        return self.end()

    def chunk(self, data: bytes) -> Iterable[bytes]:
        """One upstream read: the pieces to write to the client now, in order."""
        if self.timings.t_first_byte is None:
            self.timings.first_byte()
        if self.rewrite:  # one piece per read; journaled before it is returned if it ends
            events = self.parser.feed(data)
            if self.one_step and len(events) == 1:
                out = self._one(events[0])
                if out is not None:
                    return out
            if not self.first_out and len(events) > 1:
                return self._first_alone(events)
            return self._events(events)
        return self._as_received(data)

    def _one(self, event: Event) -> list[bytes] | None:
        """``_events((event,))`` for a stream whose step captures and strips, where
        ``event`` is a chunk after the first content and neither the end nor a chunk long
        enough to carry prompt ids; None (the exact path then) where it is not."""
        data = event.data
        if (data is None or data == DONE or len(data) > _CUT_ABOVE
                or self.timings.perf_first_content is None):
            return None
        try:
            piece = self.step(data, event)
        except (msgspec.DecodeError, msgspec.ValidationError):
            piece = event.raw  # relayed as is; capture noted the bad chunk
        self._observe()
        return [piece] if piece else []

    def _first_alone(self, events: list[Event]) -> Iterator[bytes]:
        """A read of several events before the stream's first token has gone out (an
        engine that wrote ahead while the ~0.4 MB first chunk of a long prompt was in
        transit): each event its own piece until the first token has been given out, so
        it waits for no later event of the read; from there the rest in one piece."""
        for at, event in enumerate(events):
            if self._token_seen():
                self.first_out = True
                yield from self._events(events[at:])
                return
            yield from self._events((event,))

    def _token_seen(self) -> bool:
        """Whether a token has arrived (vLLM's first chunk carries the role and no text,
        so the first token is in a later event); a capture that does not count tokens as
        they come (native Responses) says yes: its reads go out one piece each."""
        counts = self.token_counts()
        return counts is None or any(counts.values())

    def end(self) -> bytes:
        """The upstream closed the stream: what is left for the client (an unterminated
        last event, rewritten), possibly nothing."""
        self.timings.upstream_done()
        tail = self.parser.flush()
        if tail is None:
            return b""
        if not self.rewrite:
            self.event(tail)  # its bytes went out as they came
            self._observe()
            return b""
        return b"".join(self._events((tail,)))

    def _as_received(self, data: bytes) -> Iterator[bytes]:
        """Nothing to remove: the upstream's bytes go out as they came, then capture
        reads them (off the client's time)."""
        parser = self.parser
        if b"[DONE]" not in parser.tail(6) + data:
            yield data
            for event in parser.feed(data):
                self.event(event)
            self._observe()
            return
        # This read ends the stream.
        cut = max(data.find(b"data: [DONE]"), 0)
        if cut:
            yield data[:cut]
        for event in parser.feed(data):
            self.event(event)
        self._observe()
        if self.done:
            self.call.end_reached()
        yield data[cut:]

    def _events(self, events: Iterable[Event]) -> list[bytes]:
        """Events rewritten to drop what the proxy added (or translated), or held: the
        pieces to give out now (one, or none). When the end is seen on a stream that is
        not held, the call is journaled before anything is returned."""
        hold, out, rewritten = self.hold, [], self.event
        for event in events:
            if hold is None:
                out.append(rewritten(event))
                if self.done:
                    self._observe()
                    self.call.end_reached()  # as the end is seen: later events are not the call's
                continue
            held = hold.held(event, self.translator)
            piece = rewritten(event)
            if held or self.done:
                self.held += piece
            else:
                hold.sent(event)
                out.append(piece)
        self._observe()
        if len(out) == 1:  # the usual read: one event
            return out if out[0] else []
        return [b"".join(out)] if any(out) else []

    def _observe(self) -> None:
        """The tokens captured so far arrived now: their policy version (once per read, or
        per piece the read is given out in: its tokens arrived at one instant)."""
        self.versions.observe(self.token_counts())

    def _cut_prompt(self, event: Event, data: bytes) -> tuple[bytes, Event]:
        """The prompt's ids (vLLM's first chunk) cut out of ``data`` as bytes, given to
        capture: what capture reads of the chunk then, and what strip reads."""
        cut = cut_prompt_ids(data)
        if cut is None:
            return data, event
        data, prompt_ids = cut
        call = self.call
        self.capture.add_prompt_ids(prompt_ids, functools.partial(
            call.services.prompt_prefixes.decode_packed, call.episode_id))
        return data, Event(event.raw, data) if self.injected.token_ids else event

    def event(self, event: Event) -> bytes:
        """One SSE event: capture it; return the bytes the client should get for it."""
        data = event.data
        if data is None:
            return event.raw if self.translator is None else b""
        if self.api.is_end(data):
            self.done = True
            self.timings.upstream_done()
            if self.translator is not None:
                return b"".join(self.translator.finish())
            if data == b"[DONE]":
                return event.raw
        elif self.timings.perf_first_content is None:
            self.timings.first_content()
        stripped = event  # what strip_event reads: without the ids the proxy asked for
        if len(data) > _CUT_ABOVE and KEY in data and self.api.cuts_prompt_ids:
            data, stripped = self._cut_prompt(event, data)
        step = self.step
        if step is not None:  # what follows, for a chat stream (a chat capture never ends)
            try:
                return step(data, stripped)
            except (msgspec.DecodeError, msgspec.ValidationError):
                return event.raw  # relayed as is; capture noted the bad chunk
        capture, injected, translator = self.capture, self.injected, self.translator
        capture.add(data)
        if self.experts is not None:  # the tokens' routing (their version: ``_observe``)
            self.experts.add(data)
        if capture.ended and not self.done:  # a terminal event that carries data
            self.done = True
            self.timings.upstream_done()
        if translator is not None:
            # The translator reads the whole chat chunk (usage too) and writes only the
            # client's API, so nothing the proxy asked for can reach the client.
            try:
                return b"".join(
                    translator.feed(read_chunk_bytes(data, logprobs=translator.wants_logprobs))
                )
            except (msgspec.DecodeError, msgspec.ValidationError):
                return b""  # capture noted the bad chunk; the client's stream stays valid
        if not self.strip:
            return event.raw
        try:
            return self.api.strip_event(stripped, injected)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return event.raw  # relayed as is; capture noted the bad chunk


def _no_counts() -> None:
    """A reassembly that cannot count its tokens per choice as they come."""


def whole_reply(call: ModelCall, body: bytes) -> tuple[bytes, str | None]:
    """A whole reply the upstream answered 200: captured; the bytes the client gets, and
    a note for the record when they could not be rewritten."""
    call.capture.add(body)
    request = call.request
    if request.experts is not None:
        request.experts.add(body)
    if call.translation is not None:
        try:
            return encode(call.translation.from_chat(decode_object(body),
                                                     request.client_payload)), None
        except (msgspec.DecodeError, msgspec.ValidationError):
            return body, "upstream reply is not JSON: relayed as it came"
    if request.injected.any:
        try:
            return call.api.strip_body(body, request.injected), None
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass  # not the JSON we expected: the client gets it as it came
    return body, None


def broken_error(exc: UpstreamBroken) -> ProxyError:
    """The error for an upstream that failed mid-reply, before the client got any of it."""
    return ProxyError(502, f"upstream failed mid-reply: {exc}", "upstream_error",
                      "upstream_error")
