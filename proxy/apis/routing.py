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
from typing import Any, NamedTuple

from tracetap.proxy.apis import Translation, WireApi
from tracetap.proxy.apis.chat.capture import CHAT_API
from tracetap.proxy.apis.chat.errors import OPENAI_ERRORS
from tracetap.proxy.apis.messages.errors import ANTHROPIC_ERRORS
from tracetap.proxy.apis.registry import APIS, BY_NAME, BY_PATH, TRANSLATABLE
from tracetap.proxy.http.errors import ErrorShape


class Route(NamedTuple):
    api: WireApi  # what the upstream is spoken to in
    translation: Translation | None  # the client's API ⇄ chat, when translated
    endpoint: str  # stored in calls.endpoint: the client's API, ":chat" when translated
    label: str  # the metrics route label
    errors: ErrorShape  # the client's API's error body, whatever the upstream speaks


def client_errors(path: str, headers: Mapping[str, str]) -> ErrorShape:
    """The error shape a request is answered in, decided once per request: a captured
    path's own API's (the one its ``Route`` carries); for any other path Anthropic's when
    it is under ``/v1/messages`` (``count_tokens``, batches) or the client sends
    ``anthropic-version`` (Anthropic's SDKs read only their own shape), else OpenAI's."""
    api = BY_PATH.get(path.rstrip("/"))
    if api is not None:
        return api.errors
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
    def __init__(self, translate: str, native: dict[str, WireApi] | None = None):
        """``native``: the translatable APIs' native captures (default: each API's own;
        an API left out is always translated). Chat and completions are always native."""
        self.translate = parse_translate(translate)
        self.native: dict[str, WireApi] = {
            api.name: api.native() for api in APIS if api.native is not None
            and (native is None or api.translation is None)}
        self.native.update(native or {})
        self._missing: set[str] = set()  # APIs the upstream answered 404 for (auto)

    def route(self, path: str, flavor: str) -> Route | None:
        """How ``path`` is captured, or None if it is not a captured path."""
        client = BY_PATH.get(path.rstrip("/"))
        if client is None:
            return None
        name = client.name
        if name in TRANSLATABLE and self.translates(name, flavor):
            return _translated(name)
        api = self.native.get(name)
        return None if api is None else Route(api, None, api.endpoint, api.route, client.errors)

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
        return (flavor not in BY_NAME[name].native_flavors or name not in self.native
                or name in self._missing)


def _translated(name: str) -> Route:
    """The client's API ``name`` spoken to the upstream as chat completions."""
    client = BY_NAME[name]
    return Route(CHAT_API, client.translation, f"{name}:chat", name, client.errors)


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
