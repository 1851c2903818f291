"""The records the proxy hands to storage: the one typed boundary between them."""

from __future__ import annotations

import msgspec


class ChoiceRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One upstream choice (``n`` > 1 gives several per call)."""

    index: int
    finish_reason: str | None = None
    text: str | None = None
    completion_ids: list[int] | None = None
    completion_logprobs: list[float] | None = None
    # Raw per-token alternatives, only when the client asked for top_logprobs.
    top_logprobs: list | None = None
    # Where the completion ids came from: "engine", "logprobs" or "none".
    token_source: str = "none"


class CallRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Everything captured about one model call, finished or cut short."""

    call_id: str
    episode_id: str | None = None
    seq: int = 0
    instance: str = ""
    endpoint: str
    model: str | None = None
    policy_version: str | None = None
    stream: bool = False
    upstream: str | None = None
    # The client's request body (JSON text) with nothing secret in it.
    request: str | None = None
    # The upstream response as the proxy saw it; streams are reassembled.
    response: str | None = None
    status: str = "ok"
    http_status: int = 0
    error: str | None = None
    t_start: float
    t_first_byte: float | None = None
    t_end: float | None = None
    upstream_latency: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_ids: list[int] | None = None
    choices: list[ChoiceRecord] = []


# Statuses a stored call can have. "ok" covers any upstream reply, 4xx/5xx included
# (the HTTP status says which); the rest mean the exchange did not complete normally.
STATUSES = (
    "ok",
    "client_disconnected",
    "upstream_error",
    "upstream_unreachable",
    "upstream_timeout",
    "bad_request",
    "paused",
    "budget_exceeded",
    "passthrough",  # an exposed, uncaptured path (e.g. count_tokens) called in an episode
)
