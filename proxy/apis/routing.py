"""Which wire API captures a path: natively, or translated to chat completions.

Token-exact by default: an API is captured natively only where the engine returns
token ids and logprobs for it. No engine does for Anthropic's Messages (vLLM's
``/v1/messages`` gives neither), so Messages calls are translated to chat completions
unless ``--translate none``; Responses calls are native on vLLM (logprobs, and ids with
``enable_response_messages``) and translated elsewhere, and on vLLM too when the request
could get output native Responses have no logprobs for (``for_request``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any, NamedTuple

from tracetap.proxy.apis import WireApi
from tracetap.proxy.apis.chat.capture import CHAT_API, COMPLETIONS_API
from tracetap.proxy.apis.chat.errors import OPENAI_ERRORS
from tracetap.proxy.apis.messages import translate as messages_translate
from tracetap.proxy.apis.messages.errors import ANTHROPIC_ERRORS
from tracetap.proxy.apis.responses import translate as responses_translate
from tracetap.proxy.http.errors import ErrorShape

TRANSLATABLE = ("responses", "messages")
CAPTURED_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
                  "/v1/responses": "responses", "/v1/messages": "messages"}
_TRANSLATIONS = {"responses": responses_translate, "messages": messages_translate}
_NATIVE_FLAVORS = {"responses": ("vllm",), "messages": ()}
# The error shape each client API reads: Responses is an OpenAI API too.
_ERRORS: dict[str, ErrorShape] = {"chat": OPENAI_ERRORS, "completions": OPENAI_ERRORS,
                                  "responses": OPENAI_ERRORS, "messages": ANTHROPIC_ERRORS}


class Route(NamedTuple):
    api: WireApi  # what the upstream is spoken to in
    translation: ModuleType | None  # the client's API ⇄ chat, when translated
    endpoint: str  # stored in calls.endpoint: the client's API, ":chat" when translated
    label: str  # the metrics route label
    errors: ErrorShape  # the client's API's error body, whatever the upstream speaks


def client_errors(path: str, headers: Mapping[str, str]) -> ErrorShape:
    """The error shape a request is answered in, decided once per request: a captured
    path's own API's (the one its ``Route`` carries); for any other path Anthropic's when
    it is under ``/v1/messages`` (``count_tokens``, batches) or the client sends
    ``anthropic-version`` (Anthropic's SDKs read only their own shape), else OpenAI's."""
    name = CAPTURED_PATHS.get(path.rstrip("/"))
    if name is not None:
        return _ERRORS[name]
    if path.startswith("/v1/messages/") or "anthropic-version" in headers:
        return ANTHROPIC_ERRORS
    return OPENAI_ERRORS


def parse_translate(value: str) -> tuple[str, ...] | None:
    """``auto`` → None (decided per API and flavor); ``none``; ``all``; or a list."""
    value = value.strip().lower()
    if value == "auto":
        return None
    if value == "none":
        return ()
    if value == "all":
        return TRANSLATABLE
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = set(names) - set(TRANSLATABLE)
    if unknown or not names:
        raise ValueError(f"--translate must be auto, none, all or a list of "
                         f"{', '.join(TRANSLATABLE)}; got {value!r}")
    return names


class Routing:
    def __init__(self, translate: str, native: dict[str, WireApi]):
        self.translate = parse_translate(translate)
        self.native: dict[str, WireApi] = {"chat": CHAT_API, "completions": COMPLETIONS_API,
                                           **native}
        self._missing: set[str] = set()  # APIs the upstream answered 404 for (auto)

    def route(self, path: str, flavor: str) -> Route | None:
        """How ``path`` is captured, or None if it is not a captured path."""
        name = CAPTURED_PATHS.get(path.rstrip("/"))
        if name is None:
            return None
        if name in TRANSLATABLE and self.translates(name, flavor):
            return _translated(name)
        api = self.native.get(name)
        return None if api is None else Route(api, None, api.endpoint, api.route, _ERRORS[name])

    def fallback(self, route: Route) -> Route | None:
        """Under ``auto``, a native call the upstream answered 404: translate it, and
        the calls after it, instead."""
        name = route.api.endpoint
        if self.translate is not None or route.translation is not None or name not in (
                TRANSLATABLE):
            return None
        self._missing.add(name)
        return _translated(name)

    def for_request(self, route: Route, payload: dict[str, Any]) -> Route:
        """Under ``auto``, a Responses call that native capture would store without
        logprobs for part of its output (a tool-call-only turn, reasoning: vLLM's
        Responses carry logprobs on output text only) is translated to chat instead, so
        every turn is trainable (docs/translation.md)."""
        if (self.translate is not None or route.translation is not None
                or route.api.endpoint != "responses" or not native_loses_logprobs(payload)):
            return route
        return _translated("responses")

    def translates(self, name: str, flavor: str) -> bool:
        if self.translate is not None:
            return name in self.translate
        return (flavor not in _NATIVE_FLAVORS[name] or name not in self.native
                or name in self._missing)


def _translated(name: str) -> Route:
    """The client's API ``name`` spoken to the upstream as chat completions."""
    return Route(CHAT_API, _TRANSLATIONS[name], f"{name}:chat", name, _ERRORS[name])


def native_loses_logprobs(payload: dict[str, Any]) -> bool:
    """Whether a Responses request may get output that native Responses capture stores
    without logprobs: function calls (the request offers tools) or reasoning (it asks for
    reasoning settings or encrypted reasoning, or its history holds reasoning items)."""
    if payload.get("tools"):
        return True
    reasoning = payload.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") != "none":
        return True
    include = payload.get("include")
    if isinstance(include, list) and any(
            isinstance(x, str) and x.startswith("reasoning.") for x in include):
        return True
    items = payload.get("input")
    return isinstance(items, list) and any(
        isinstance(item, dict) and item.get("type") == "reasoning" for item in items)
