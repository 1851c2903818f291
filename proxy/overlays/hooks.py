"""What an overlay implements, and the typed values its hooks receive and return.

Every hook is optional and must be ``async``. An overlay is any object with some of:

    async def on_episode_start(self, episode: EpisodeInfo) -> Any        # the state
    async def before_model(self, request: ModelRequest, state) -> Inject | None
    async def after_model(self, reply: ModelReply, state) -> Rewrite | Veto | None
    async def on_observation(self, observations: list[Observation], state) -> Inject | None

``None`` means "leave it as it is". Hooks get copies: changing them changes nothing.
An overlay whose ``after_model`` judges tool calls only says so with the attribute
``after_model_sees = "tool_calls"`` (default ``"reply"``): a streamed reply's text before
its first tool call then reaches the client live, a reply without tool calls is not
judged, and a ``Rewrite`` can replace only the tool calls (docs/overlays.md).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

HOOKS = ("on_episode_start", "before_model", "after_model", "on_observation")


class EpisodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What registration said about the episode (``id`` only when opted in by header)."""

    id: str
    task_id: str | None = None
    harness: str | None = None
    metadata: dict[str, Any] = {}


class ModelRequest(msgspec.Struct, frozen=True, kw_only=True):
    """The chat request the model is about to get (earlier overlay additions included)."""

    model: str | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


class Observation(msgspec.Struct, frozen=True, kw_only=True):
    """One tool result the harness sends back after the model's last turn."""

    tool_call_id: str | None
    name: str | None  # the tool the model called, when the earlier turn says
    content: str


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    id: str | None
    name: str | None
    arguments: str  # JSON text, exactly as the model wrote it


class ModelReply(msgspec.Struct, frozen=True, kw_only=True):
    """The model's proposed turn (first choice), with the tools it was offered."""

    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None
    tools: list[dict[str, Any]] | None
    attempt: int  # 0 for the first sample, 1 for the first re-sample, ...


class Inject(msgspec.Struct, frozen=True, kw_only=True):
    """Messages to add to the model's context (pre-decision, post-feedback): after the
    request's messages ("end") or after its leading system messages ("after_system").
    They stay in the model's context, at that place, for the rest of the episode."""

    messages: list[dict[str, Any]]
    at: Literal["end", "after_system"] = "end"
    reason: str = ""


class Rewrite(msgspec.Struct, frozen=True, kw_only=True):
    """What the harness receives instead of the model's turn (pre-action)."""

    content: str | None
    tool_calls: list[ToolCall] = []
    reason: str = ""


class Veto(msgspec.Struct, frozen=True, kw_only=True):
    """Reject the model's turn; it is asked again with ``feedback`` as a user message
    after its rejected turn, up to ``--overlay-max-resamples`` times."""

    feedback: str
    reason: str = ""


# What a hook did, in calls.overlay and tracetap_overlay_events_total{action}.
ACTIONS = (
    "inject",
    "accept",
    "rewrite",
    "veto",
    "resample_limit",
    "error",
    "timeout",
    "not_covered",
)


class OverlayEvent(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    hook: str
    action: str  # one of ACTIONS
    reason: str = ""


class OverlayLog(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Stored as JSON in calls.overlay for every call of an episode with an overlay."""

    name: str
    patch: str | None = None  # a runtime patch's sha256 (the source that ran)
    events: list[OverlayEvent] = []
    attempt: int = 0  # 0: the harness's own request; k: the k-th re-sample
    retry_of: str | None = None  # the call id of the vetoed attempt this one replaces
    # What the harness received, when it is not the model's reply (a rewrite), as JSON
    # text in the client's API (streams: the reply they spell, reassembled).
    delivered: str | None = None
