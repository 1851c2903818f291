"""Which overlay a call runs under, and its hooks called under a time budget.

A hook that raises, runs past ``--overlay-timeout`` or returns something it should not
leaves the call as it was (``--overlay-fail open``, the default) or fails it with a clear
error (``closed``); either way it is logged and counted.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from tracetap.proxy.http.errors import ProxyError, bad_request
from tracetap.proxy.http.headers import OVERLAY_HEADER
from tracetap.proxy.overlays.context import Context, leading_system
from tracetap.proxy.overlays.hooks import (
    EpisodeInfo,
    Inject,
    ModelRequest,
    Observation,
    OverlayEvent,
    OverlayLog,
)

if TYPE_CHECKING:
    from tracetap.proxy.call.driver import ModelCall
    from tracetap.proxy.overlays.patches import Patches
    from tracetap.proxy.runtime.metrics import Metrics

log = logging.getLogger("tracetap.overlays")

MAX_EPISODES = 10_000  # episodes whose overlay state is kept; least recently used go first


class EpisodeOverlay:
    """One episode under one overlay: the overlay's state and what it added."""

    def __init__(self, name: str, overlay: Any) -> None:
        self.name = name
        self.overlay = overlay
        self.state: Any = None
        self.context = Context()
        self.started = False
        self.lock = asyncio.Lock()  # concurrent first calls wait for the one start


class Overlays:
    """The loaded overlays and the episodes that run under them (one per proxy)."""

    def __init__(
        self,
        loaded: Mapping[str, Any],
        *,
        fail: str,
        timeout: float,
        max_resamples: int,
        metrics: Metrics | None,
        registered: Callable[[str], Awaitable[dict[str, Any] | None]],
        patches: Patches | None = None,
    ) -> None:
        self.loaded = dict(loaded)
        self.patches = patches  # installed at run time (admin API), run out of process
        self.fail_closed = fail == "closed"
        self.timeout = timeout
        self.max_resamples = max_resamples
        self.metrics = metrics
        self._registered = registered  # the episode's registration, from the database
        self._infos: OrderedDict[str, EpisodeInfo | None] = OrderedDict()
        self._episodes: OrderedDict[tuple[str, str], EpisodeOverlay] = OrderedDict()

    # -- registration -----------------------------------------------------------------
    async def check(self, name: str) -> Any:
        """The overlay of that name (loaded at start, or a patch installed at run time)."""
        found = await self._named(name)
        if found is None:  # what is loaded is not said: `tracetap serve`'s log lists it
            raise bad_request(f"unknown overlay {name!r}: neither loaded at start (--overlay) "
                              "nor installed (PUT /tracetap/overlays/NAME)", "unknown_overlay")
        return found

    async def _named(self, name: str) -> Any:
        if name in self.loaded:
            return self.loaded[name]
        return None if self.patches is None else await self.patches.get(name)

    def register(self, info: EpisodeInfo) -> None:
        """An episode registered with ``"overlay"`` in its metadata (checked already)."""
        self._remember(self._infos, info.id, info)

    # -- per call ---------------------------------------------------------------------
    async def session(self, call: ModelCall, headers: Mapping[str, str]) -> Session | None:
        """The overlay this call runs under, started for its episode; None if none. Only
        the operator chooses it, at registration (``tracetap run --overlay``): the agent's
        header is refused (400, counted), whatever it names, and the refusal names nothing
        that is loaded, so the episode's metadata always says which overlay its calls ran
        under (``tracetap compare`` never counts an overlaid call as baseline)."""
        if OVERLAY_HEADER in headers:
            raise bad_request(f"{OVERLAY_HEADER} is not accepted: an episode's overlay is "
                              "chosen by the operator, at its registration", "overlay_header")
        if call.episode_id is None or not (self.loaded or (self.patches and self.patches.any)):
            return None
        info = await self._info(call.episode_id)
        name = None if info is None else info.metadata.get("overlay")
        overlay = None if name is None else await self._named(name)
        if overlay is None:
            return None  # an overlay this proxy did not load (stated at start), or deleted
        events: list[OverlayEvent] = []
        episode = await self._episode(
            name, overlay, info or EpisodeInfo(id=call.episode_id), events)
        session = Session(self, episode, events)
        call.under_overlay(session.log)
        return session

    async def _info(self, episode_id: str) -> EpisodeInfo | None:
        if episode_id in self._infos:
            self._infos.move_to_end(episode_id)
            return self._infos[episode_id]
        row = await self._registered(episode_id)  # registered on another replica, or before
        info = (
            None
            if row is None
            else EpisodeInfo(
                id=episode_id,
                task_id=row.get("task_id"),
                harness=(row.get("harness") or {}).get("name"),
                metadata=row.get("metadata") or {},
            )
        )
        self._remember(self._infos, episode_id, info)
        return info

    async def _episode(
        self, name: str, overlay: Any, info: EpisodeInfo, events: list[OverlayEvent]
    ) -> EpisodeOverlay:
        key = (info.id, name)
        episode = self._episodes.get(key)
        if episode is None or episode.overlay is not overlay:  # new, or a patch replaced
            episode = EpisodeOverlay(name, overlay)
        self._remember(self._episodes, key, episode)
        if not episode.started:
            async with episode.lock:
                if not episode.started:  # a start that failed closed is tried again
                    episode.state = await self.run(
                        episode, events, "on_episode_start", copy.deepcopy(info)
                    )
                    episode.started = True
        return episode

    @staticmethod
    def _remember(cache: OrderedDict, key, value) -> None:
        cache[key] = value
        cache.move_to_end(key)
        if len(cache) > MAX_EPISODES:
            cache.popitem(last=False)

    # -- hooks ------------------------------------------------------------------------
    async def run(
        self,
        episode: EpisodeOverlay,
        events: list[OverlayEvent],
        hook: str,
        *args: Any,
        returns: tuple[type, ...] = (),
    ) -> Any:
        """One hook under the budget: its result, or None when it failed open."""
        fn = getattr(episode.overlay, hook, None)
        if fn is None:
            return None
        try:
            ready = getattr(episode.overlay, "ready", None)
            if ready is not None:  # a runtime patch: its worker started, outside the budget
                await ready()
            result = await asyncio.wait_for(fn(*args), self.timeout)
            if returns and result is not None and not isinstance(result, returns):
                raise TypeError(
                    f"returned {type(result).__name__}, not "
                    f"{' or '.join(t.__name__ for t in returns)} or None"
                )
            return result
        except asyncio.TimeoutError:
            action, why = "timeout", f"ran past its {self.timeout:g} s budget"
        except Exception as exc:
            action, why = "error", f"{type(exc).__name__}: {exc}"
        self.event(episode.name, events, hook, action, why)
        log.warning(
            "overlay %s: %s %s (%s)",
            episode.name,
            hook,
            why,
            "call failed" if self.fail_closed else "call left as it was",
        )
        if self.fail_closed:
            raise ProxyError(
                500,
                f"overlay {episode.name!r} failed in {hook}: {why}",
                "server_error",
                "overlay_failed",
            )
        return None

    def event(
        self, name: str, events: list[OverlayEvent], hook: str, action: str, reason: str = ""
    ) -> None:
        events.append(OverlayEvent(hook=hook, action=action, reason=reason[:500]))
        if self.metrics is not None:
            self.metrics.child(self.metrics.overlay_events, name, hook, action).inc()


class Session:
    """One call under an overlay: its log (stored with the call) and its hooks."""

    def __init__(
        self, overlays: Overlays, episode: EpisodeOverlay, events: list[OverlayEvent]
    ) -> None:
        self.overlays = overlays
        self.episode = episode
        self.log = OverlayLog(name=episode.name, events=events, patch=self.patch)
        self.harness: list[dict[str, Any]] = []  # the harness's messages (chat-shaped calls)

    @property
    def patch(self) -> str | None:
        """The sha256 of the patch's source, for a patch installed at run time."""
        return getattr(self.episode.overlay, "sha256", None)

    def event(self, hook: str, action: str, reason: str = "") -> None:
        self.overlays.event(self.episode.name, self.log.events, hook, action, reason)

    async def hook(self, hook: str, *args: Any, returns: tuple[type, ...] = ()) -> Any:
        return await self.overlays.run(self.episode, self.log.events, hook, *args, returns=returns)

    def chat_shaped(self, call: ModelCall) -> bool:
        """Chat completions, or an API translated to chat: what the hooks read."""
        return call.api.speaks_chat and isinstance(call.request.payload.get("messages"), list)

    @property
    def reviews(self) -> bool:
        return getattr(self.episode.overlay, "after_model", None) is not None

    @property
    def sees_tool_calls_only(self) -> bool:
        """``after_model`` judges tool calls only: text before them may go out live."""
        return getattr(self.episode.overlay, "after_model_sees", "reply") == "tool_calls"

    def reviews_reply(self, call: ModelCall) -> bool:
        """Whether the reply waits for ``after_model`` (one choice of a chat call)."""
        one_choice = call.request.payload.get("n") in (None, 1)
        return self.reviews and self.chat_shaped(call) and one_choice

    async def prepare(self, call: ModelCall, body: bytes) -> bytes:
        """The request side: observations, then pre-decision; returns the upstream body."""
        if not self.chat_shaped(call):
            self.event("before_model", "not_covered", f"{call.endpoint} is not chat-shaped")
            return body
        harness: list[dict[str, Any]] = call.request.payload["messages"]
        self.harness = harness
        context = self.episode.context
        observations = _observations(harness)
        if observations:
            found = await self.hook(
                "on_observation", observations, self.episode.state, returns=(Inject,)
            )
            self._add(found, "on_observation", harness)
        request = ModelRequest(
            model=call.model,
            messages=copy.deepcopy(context.apply(harness)),
            tools=copy.deepcopy(call.request.payload.get("tools")),
        )
        found = await self.hook("before_model", request, self.episode.state, returns=(Inject,))
        self._add(found, "before_model", harness)
        return self.model_body(call, harness)

    def model_body(self, call: ModelCall, harness: list[dict[str, Any]]) -> bytes:
        """The upstream body with the episode's additions; the harness's own if none fit."""
        return call.model_view(self.episode.context.apply(harness), harness)

    def _add(self, found: Inject | None, hook: str, harness: list[dict[str, Any]]) -> None:
        if found is None:
            return
        bad = [m for m in found.messages if not isinstance(m, dict) or "role" not in m]
        if bad or not found.messages:
            self.event(hook, "error", "an Inject needs messages, each a dict with a role")
            return
        anchor = len(harness) if found.at == "end" else leading_system(harness)
        self.episode.context.add(harness, anchor, copy.deepcopy(found.messages))
        self.event(hook, "inject", found.reason)


def _observations(messages: list[dict[str, Any]]) -> list[Observation]:
    """The tool results after the last assistant turn (what its tool calls returned)."""
    names: dict[str, str] = {}
    start = len(messages)
    while start > 0 and messages[start - 1].get("role") == "tool":
        start -= 1
    if start == len(messages):
        return []
    if start > 0 and messages[start - 1].get("role") == "assistant":
        for tool_call in messages[start - 1].get("tool_calls") or ():
            if isinstance(tool_call, dict) and isinstance(tool_call.get("function"), dict):
                names[tool_call.get("id")] = tool_call["function"].get("name")
    return [
        Observation(
            tool_call_id=m.get("tool_call_id"),
            name=names.get(m.get("tool_call_id")),
            content=_text(m.get("content")),
        )
        for m in messages[start:]
    ]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)
