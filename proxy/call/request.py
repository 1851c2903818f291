"""One model call's request: as the client sent it, and as it goes to the upstream.

``CallRequest`` is the request side of a call: ``decode`` (validation), then ``prepare``
(the model map, translation to chat with its drops counted, history repair, the engine
controls dropped (proxy.apis.fields) and the API's additions for logprobs / ids /
usage) once ``ModelCall`` has chosen the route (``--translate auto``). Only
``ModelCall`` calls its methods; everything else reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from tracetap.proxy.apis import Injected
from tracetap.proxy.apis.chat.wire import decode_object, encode
from tracetap.proxy.apis.dropped import Dropped
from tracetap.proxy.call import routed_experts as experts
from tracetap.proxy.http.errors import bad_request

if TYPE_CHECKING:
    from tracetap.proxy.apis.routing import Route
    from tracetap.proxy.call.services import CallServices


class CallRequest:
    __slots__ = (
        "body",
        "client_payload",
        "dropped",
        "experts",
        "fields_dropped",
        "harness_messages",
        "injected",
        "model",
        "other_model",
        "payload",
        "repaired",
        "stream",
        "upstream_request",
    )

    def __init__(self, body: bytes | None = None) -> None:
        self.body = body  # as the client sent it (kept as bytes: the handler holds them)
        self.payload: dict[str, Any] = {}  # as sent upstream
        self.client_payload: dict[str, Any] = {}  # as the client sent it, when translated
        self.dropped = Dropped()  # what translation left out of the client's request
        self.fields_dropped: dict[str, int] = {}  # engine controls kept from the engine
        self.upstream_request: bytes | None = None  # the engine's view, when not the client's
        self.harness_messages: list[dict[str, Any]] | None = None  # before an overlay's additions
        self.repaired = False  # the model's own turns put back (proxy.episodes.repair)
        self.injected = Injected()  # what the API's prepare added for capture
        self.experts: experts.CallExperts | None = None  # the MoE routing asked for
        self.stream = False
        self.model: str | None = None  # the model asked of the upstream (a string), if any
        self.other_model = False  # not its episode's policy model (proxy.episodes.policy_models)

    def model_view(self, messages: list[dict[str, Any]], harness: list[dict[str, Any]]) -> bytes:
        """The upstream body with ``messages`` in place of the harness's (an overlay's
        additions); stored beside the client's request when they differ."""
        self.payload["messages"] = messages
        body = encode(self.payload)
        if messages is not harness:
            self.upstream_request = body
            self.harness_messages = harness
        return body

    def parse(self, body: bytes, route: Route, services: CallServices,
              episode_id: str | None) -> tuple[Route, bytes]:
        """The client's body read and made ready for the upstream: the route it goes on
        (``--translate auto`` may translate this request: ``Routing.for_request``) and
        the body to send (raises a 400 ProxyError)."""
        self.body = body
        payload = self.decode()
        route = services.routing.for_request(route, payload)
        return route, self.prepare(payload, route, services, episode_id)

    def decode(self) -> dict[str, Any]:
        """The client's JSON object (raises a 400 ProxyError)."""
        try:
            payload = decode_object(self.body)
        except msgspec.DecodeError as exc:
            raise bad_request(f"request body is not valid JSON: {exc}", "invalid_json") from exc
        except msgspec.ValidationError as exc:
            raise bad_request("request body must be a JSON object", "invalid_json") from exc
        except RecursionError as exc:  # msgspec's own depth limit
            raise bad_request("request body nests JSON too deeply", "invalid_json") from exc
        self.stream = payload.get("stream") is True
        return payload

    def prepare(self, payload: dict[str, Any], route: Route, services: CallServices,
                episode_id: str | None) -> bytes:
        """The body to send upstream on ``route`` (raises a 400 ProxyError when the
        request cannot be translated)."""
        services.model_map.apply(payload)
        translation = route.translation
        fields = services.request_fields
        if translation is not None:
            # Translation builds the chat body from the fields it maps (and counts the
            # rest): the engine controls among them are named in the same count as native.
            self.fields_dropped = fields.drop_controls(payload)
            self.client_payload = payload
            try:
                payload = translation.to_chat(payload, dropped=self.dropped,
                                              flavor=services.flavor)
            except translation.Untranslatable as exc:
                raise translation.untranslatable(exc) from exc
        self.repaired = services.repair.apply(episode_id, route.api.speaks_chat, payload)
        # Before capture's additions: what the agent sent that is not a sampling field.
        for name, n in fields.drop(route.api.endpoint, payload).items():
            self.fields_dropped[name] = self.fields_dropped.get(name, 0) + n
        self.payload = payload
        model = payload.get("model")
        self.model = model if isinstance(model, str) else None
        self.injected = route.api.prepare(payload, services.flavor)
        self.experts = experts.ask(self, route.api, services.routed_experts)
        # What goes upstream is the payload as tracetap read and checked it, encoded again,
        # never the client's bytes: a member written twice (at any depth) or spelled with
        # escapes reaches the engine once, as tracetap saw it, whichever of the values the
        # engine's parser would keep (vLLM's keeps the last, a simdjson-based one the
        # first). ~0.2 ms at 72k tokens of context.
        body = encode(payload)
        if translation is not None or self.repaired or self.fields_dropped:
            self.upstream_request = body  # stored beside the client's request
        return body
