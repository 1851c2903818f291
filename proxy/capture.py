"""One model call being captured: request in, reply relayed, record out.

The record is submitted in the handler's ``finally``, so a cancelled handler (client
gone) still stores what it saw. What differs between wire APIs lives in ``api`` (the API
spoken to the upstream) and ``translation`` (set when the client speaks another API
than the upstream: its request and replies are converted to and from chat).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from tracetap.proxy.apis.chat_reply import read_chunk_bytes
from tracetap.proxy.errors import ProxyError, bad_request
from tracetap.proxy.inject import COMPLETIONS, Injected
from tracetap.proxy.routing import Route
from tracetap.proxy.sse import Event
from tracetap.proxy.state import ProxyState
from tracetap.proxy.wire import decode_object, encode
from tracetap.storage.records import CallRecord


class ModelCall:
    def __init__(self, state: ProxyState, route: Route, call_id: str):
        self.state = state
        self.api = api = route.api
        self.translation = route.translation  # a translate module, or None when native
        self.endpoint = route.endpoint
        self.call_id = call_id
        self.t_start = time.time()
        self.perf_start = time.perf_counter()
        self.episode_id: str | None = None
        self.request_text: str | None = None
        self.payload: dict[str, Any] = {}
        self.injected = Injected()
        self.capture = api.capture(self.injected)
        self.client_payload: dict[str, Any] = {}  # as the client sent it, when translated
        self.upstream_request: bytes | None = None  # the engine's view, when not the client's
        self.repaired = False  # the model's own turns put back (proxy.repair)
        self.overlay = None  # proxy.overlays.hooks.OverlayLog, when an overlay runs
        self.stream_translator = None
        self.stream = False
        self.status = "ok"
        self.http_status = 0
        self.error: str | None = None
        self.t_first_byte: float | None = None
        self.perf_upstream_start: float | None = None
        self.perf_upstream_end: float | None = None
        self.perf_first_content: float | None = None
        self.client_body: bytes | None = None
        self.seq: int | None = None
        self.policy_version: str | None = None
        self.upstream_url: str | None = None
        self.admitted = False
        self.done = False  # the upstream sent its end-of-stream marker
        self.submitted = False

    # -- request side -----------------------------------------------------------
    def reroute(self, route: Route, body: bytes) -> bytes:
        """Speak another API to the upstream (the first answered 404): the client's
        request is prepared again from its original bytes."""
        self.api, self.translation, self.endpoint = route.api, route.translation, route.endpoint
        return self.parse_request(body)

    def parse_request(self, body: bytes) -> bytes:
        """Validate the client's JSON and return the body to send upstream."""
        self.request_text = body.decode("utf-8", "replace")
        try:
            payload = decode_object(body)
        except msgspec.DecodeError as exc:
            raise bad_request(f"request body is not valid JSON: {exc}", "invalid_json") from exc
        except msgspec.ValidationError as exc:
            raise bad_request("request body must be a JSON object", "invalid_json") from exc
        self.stream = payload.get("stream") is True
        rewritten = self.state.model_map.apply(payload)
        if self.translation is not None:
            self.client_payload = payload
            try:
                payload = self.translation.to_chat(payload)
            except self.translation.Untranslatable as exc:
                raise bad_request(f"cannot translate this request to chat completions: "
                                  f"{exc.message}", "untranslatable") from exc
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
    def rewrites_stream(self) -> bool:
        """Whether stream events must be parsed and rewritten (else relayed as they come)."""
        return (self.injected.any or self.translation is not None
                or not self.api.ends_with_done)

    @property
    def model(self) -> str | None:
        return _str(self.payload.get("model"))

    def fail(self, error: ProxyError, status: str) -> web.Response:
        self.status = status
        self.http_status = error.status
        self.error = error.message
        return error.response(anthropic=self.endpoint.startswith("messages"))

    # -- reply side ---------------------------------------------------------------
    def upstream_started(self) -> None:
        self.perf_upstream_start = time.perf_counter()

    def upstream_done(self) -> None:
        if self.perf_upstream_end is None:
            self.perf_upstream_end = time.perf_counter()

    def first_byte(self) -> None:
        if self.t_first_byte is None:
            self.t_first_byte = time.time()

    def client_view(self, body: bytes, ok: bool) -> bytes:
        """A whole reply: capture it, and return what the client should receive."""
        if not ok:
            if self.translation is not None:
                body = self.translation.error_from_chat(self.http_status, body)
            self.client_body = body
            return body
        self.capture.add(body)
        if self.translation is not None:
            try:
                body = encode(self.translation.from_chat(decode_object(body),
                                                         self.client_payload))
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.error = "upstream reply is not JSON: relayed as it came"
        elif self.injected.any:
            try:
                body = self.api.strip_body(body, self.injected)
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass  # not the JSON we expected: the client gets it as it came
        self.client_body = body
        return body

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
        self.capture.add(data)
        if self.capture.ended and not self.done:  # a terminal event that carries data
            self.done = True
            self.upstream_done()
        if translator is not None:
            # The translator reads the whole chat chunk (usage too) and writes only the
            # client's API, so nothing the proxy asked for can reach the client.
            try:
                return b"".join(translator.feed(
                    read_chunk_bytes(data, logprobs=translator.wants_logprobs)))
            except (msgspec.DecodeError, msgspec.ValidationError):
                return b""  # capture noted the bad chunk; the client's stream stays valid
        if not self.injected.any:
            return event.raw
        try:
            return self.api.strip_event(event, self.injected)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return event.raw  # relayed as is; capture noted the bad chunk

    # -- record ---------------------------------------------------------------------
    def submit(self) -> None:
        """Journal the record, once. Streams do this before the client sees [DONE], so a
        call that completed for the client is on disk even if the process dies next."""
        if not self.submitted:
            self.submitted = True
            self.state.submit(self.record())
            self.state.repair.remember(self)

    def record(self) -> CallRecord:
        state = self.state
        capture = self.capture
        choices = capture.choices()
        if capture.errors and self.error is None:
            self.error = "; ".join(capture.errors)
        if self.stream and capture.response_id is not None:
            reassembled = capture.reassembled(with_logprobs=not self.injected.logprobs)
            if self.translation is not None:
                reassembled = self.translation.from_chat(reassembled, self.client_payload)
            response = encode(reassembled)
        else:
            response = self.client_body
        prompt_tokens, completion_tokens = capture.tokens()
        prompt_ids, prompt_source = capture.prompt_ids, None
        if prompt_ids is None and self.endpoint == COMPLETIONS:
            prompt_ids = _token_prompt(self.payload.get("prompt"))
            prompt_source = None if prompt_ids is None else "request"
        model = capture.model or _str(self.payload.get("model"))
        upstream_latency = None
        if self.perf_upstream_start is not None and self.perf_upstream_end is not None:
            upstream_latency = self.perf_upstream_end - self.perf_upstream_start
        return CallRecord(
            call_id=self.call_id,
            episode_id=self.episode_id,
            seq=state.arrivals.next(self.episode_id) if self.seq is None else self.seq,
            instance=state.instance,
            endpoint=self.endpoint,
            model=model,
            policy_version=self.policy_version,
            stream=self.stream,
            upstream=self.upstream_url,
            request=self.request_text,
            response=None if response is None else response.decode("utf-8", "replace"),
            status=self.status,
            http_status=self.http_status,
            error=self.error,
            t_start=self.t_start,
            t_first_byte=self.t_first_byte,
            t_end=time.time(),
            upstream_latency=upstream_latency,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            prompt_ids=prompt_ids,
            prompt_source=prompt_source,
            upstream_request=None if self.upstream_request is None
            else self.upstream_request.decode("utf-8", "replace"),
            overlay=None if self.overlay is None else encode(self.overlay).decode(),
            choices=choices,
        )


def _token_prompt(prompt: Any) -> list[int] | None:
    """A completions prompt given as token ids is the prompt's ids."""
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None
