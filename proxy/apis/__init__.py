"""The wire APIs a model call can speak, each behind the same small interface.

An API module knows, for its own request and reply shapes, how to ask the upstream for
what capture needs (``prepare``), how to take that out again (``strip_body``,
``strip_event``), when a stream has ended (``is_end``) and how to reassemble a reply
into choice records (``capture``). A client API the upstream cannot serve token-exact is
translated to chat completions (``responses/translate.py``, ``messages/translate.py``).
Handlers and ``ModelCall`` never branch on the API. ``routing`` says which API (native
or translated) captures a path.

Each API package also reads its stored calls as a conversation (``conversation.py``,
``storage.conversation``'s types), for everything that reads a conversation.

Owns: `chat/`, `responses/`, `messages/` (one package per wire API), `registry` (the
APIs, one line each, and their conversation readers), `routing`, `fields` (what may
reach the engine), `dropped`, `translate_errors`, `wire_out`, `reasoning_options`.
May import: `http`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import msgspec

from tracetap.proxy.http.errors import ErrorShape
from tracetap.proxy.http.sse import Event
from tracetap.storage.conversation import Reader, Shape
from tracetap.storage.records import ChoiceRecord


class Injected(msgspec.Struct, kw_only=True):
    """What the proxy added to one request (``prepare``), so it can be taken out again."""

    logprobs: bool = False
    usage: bool = False
    token_ids: bool = False
    # What the client itself asked for, kept for storage decisions.
    client_top_logprobs: int = 0
    # Responses echo ``top_logprobs``: null again when the client did not set it.
    top_logprobs_echo: bool = False
    # MoE routing (--routed-experts, proxy.call.routed_experts): removed from every reply.
    experts: bool = False
    # SGLang chat: the ids asked in ``sglext`` (proxy.apis.chat.inject), removed from every reply.
    sglext: bool = False

    @property
    def any(self) -> bool:
        return self.logprobs or self.usage or self.token_ids or self.experts or self.sglext


class Reassembly(Protocol):
    """Accumulates one upstream reply (a body, or stream events)."""

    model: str | None
    prompt_ids: list[int] | None
    errors: list[str]
    logprobs_missing: int  # counted by choices()
    choice_count: int  # counted by choices()
    unknown_events: int  # stream events of types this API's capture does not know
    ended: bool  # a terminal event (one that carries data) has been seen

    def add(self, data: bytes) -> None: ...
    def choices(self) -> list[ChoiceRecord]: ...
    def tokens(self) -> tuple[int | None, int | None]: ...  # prompt, completion usage


class CaptureBase:
    """The ids and counters every reassembly reports, starting empty."""

    def __init__(self) -> None:
        self.model: str | None = None
        self.response_id: str | None = None
        self.prompt_ids: list[int] | None = None
        self.errors: list[str] = []
        self.logprobs_missing = 0
        self.choice_count = 0
        self.unknown_events = 0
        self.ended = False


class WireApi(Protocol):
    endpoint: str  # stored in calls.endpoint
    route: str  # the metrics label
    path: str  # the upstream path, under /v1
    ends_with_done: bool  # streams end with ``data: [DONE]`` (else with a terminal event)
    # What the call's spine may do with this API's calls (chat's; False for the others):
    # a stream cut by a weight sync continued token for token (call/continuation.py); the
    # prompt's ids cut out of the first chunk by their bytes (apis/chat/prompt_cut.py);
    # MoE routing asked for (call/routed_experts.py); the prompt's ids read from the
    # request when the engine returns none (a legacy completions prompt of token ids).
    speaks_chat: bool  # the upstream is sent chat messages: what repair and overlays read
    continuable: bool
    cuts_prompt_ids: bool
    routed_experts: bool
    prompt_in_request: bool

    def prepare(self, payload: dict[str, Any], flavor: str) -> Injected: ...
    def strip_body(self, body: bytes, injected: Injected) -> bytes: ...
    def strip_event(self, event: Event, injected: Injected) -> bytes: ...
    def is_end(self, data: bytes) -> bool: ...
    def capture(self, injected: Injected) -> Reassembly: ...


class StreamTranslating(Protocol):
    """Writes a translated stream's client events from chat chunks."""

    wants_logprobs: bool  # the client asked for logprobs (they stay in its events)

    def feed(self, chunk: Any) -> list[bytes]: ...
    def finish(self) -> list[bytes]: ...


class Translation(Protocol):
    """A client API spoken to the upstream as chat completions: its package's
    ``translate`` module (``responses/translate.py``, ``messages/translate.py``)."""

    def StreamTranslator(self, request: dict[str, Any], *,
                         response_id: str | None = None) -> StreamTranslating: ...
    def to_chat(self, request: dict[str, Any], **options: Any) -> dict[str, Any]: ...
    def from_chat(self, chat: dict[str, Any], request: dict[str, Any], *,
                  response_id: str | None = None) -> dict[str, Any]: ...
    def error_from_chat(self, status: int, body: bytes) -> bytes: ...
    def untranslatable(self, exc: Exception) -> Exception: ...


class Caps(NamedTuple):
    """What a request lets the model generate (the episode budget's reservation)."""

    tokens: int | None = None  # its completion-token cap; None: it states none
    choices: int = 1  # completions generated (chat's ``n``)


def read_caps(request: Mapping[str, Any], keys: tuple[str, ...], n: str | None = None) -> Caps:
    """The first of ``keys`` that holds a positive integer, and ``n``'s count of choices
    (1 to 128; else 1): what an API's ``caps`` reads with its own keys."""
    cap = next((v for k in keys if type(v := request.get(k)) is int and v > 0), None)
    count = request.get(n) if n is not None else None
    return Caps(cap, count if type(count) is int and 0 < count <= 128 else 1)


class ClientApi(NamedTuple):
    """One wire API a client may speak, as the registry (``apis/registry.py``) lists it:
    each API package's ``api.py`` makes its own."""

    name: str  # the key of --translate, and of the tables that follow from this one
    path: str  # the captured path
    exposed: tuple[str, ...]  # the paths an agent may POST for it (the captured one first)
    errors: ErrorShape  # the error body its clients read
    native: Callable[[], WireApi] | None  # its capture when spoken to the upstream as is
    native_flavors: tuple[str, ...]  # engines that serve it token-exact natively
    translation: Translation | None  # spoken to the upstream as chat instead, when set
    # Its stored request and reply read as a conversation (its ``conversation.py``): what
    # the viewer, analysis and lineage read instead of its shapes.
    reader: Reader
    shape: Shape  # where its stored request holds its messages (storage's blocks, search)
    caps: Callable[[Mapping[str, Any]], Caps]  # its request's completion cap (the budgets')
