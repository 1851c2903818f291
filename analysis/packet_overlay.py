"""What an overlay did to a failed episode, for its packet (analysis.packets): the
overlay installed (the episode's metadata ``overlay``, else the name in its calls'
records) and every event of every call, vetoed attempts included, from ``calls.overlay``
(docs/overlays.md, "What is recorded")."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import msgspec

from tracetap.analysis import conversation
from tracetap.analysis.episodes import Episode
from tracetap.storage.summaries import CallSummary


class OverlayEvent(msgspec.Struct, kw_only=True, gc=False):
    call_id: str
    attempt: int
    hook: str | None
    action: str | None
    reason: str | None


class Overlay(msgspec.Struct, kw_only=True, gc=False):
    """The overlay installed for the episode and everything it did (docs/overlays.md)."""

    name: str | None  # the episode's metadata "overlay", else the calls' records
    events: list[OverlayEvent]  # every call's, in arrival order (vetoed attempts too)
    injected_context: list[dict[str, Any]]  # what it added before the first step


def overlay_of(
    e: Episode,
    calls: list[CallSummary],
    records: dict[str, str],
    before: list[dict[str, Any]],
    budget: int,
) -> Overlay | None:
    """The episode's overlay and its events; None when no overlay touched it."""
    name = e.metadata.get("overlay")
    events, named = [], None
    for c in calls:
        record = conversation.json_object(records.get(c.call_id))
        named = named or record.get("name")
        attempt = record.get("attempt") if isinstance(record.get("attempt"), int) else 0
        for event in record.get("events") or ():
            if isinstance(event, dict):
                events.append(
                    OverlayEvent(
                        call_id=c.call_id,
                        attempt=attempt,
                        hook=_str(event.get("hook")),
                        action=_str(event.get("action")),
                        reason=conversation.cut(_str(event.get("reason")), budget),
                    )
                )
    if name is None and named is None and not events and not before:
        return None
    return Overlay(name=_str(name) or _str(named), events=events, injected_context=before)


def events_by_action(
    calls: list[CallSummary], records: dict[str, str], events: list[OverlayEvent]
) -> dict[str, list[dict[str, Any]]]:
    """Per call that produced an action: its events and those of the vetoed attempts it
    was asked again for (``retry_of``, followed back)."""
    retry_of = {
        c.call_id: conversation.json_object(records.get(c.call_id)).get("retry_of")
        for c in calls
    }
    by_call: dict[str, list[OverlayEvent]] = defaultdict(list)
    for event in events:
        by_call[event.call_id].append(event)
    out: dict[str, list[dict[str, Any]]] = {}
    for c in calls:
        chain, at, seen = [], c.call_id, set()
        while isinstance(at, str) and at not in seen:
            seen.add(at)
            chain.append(at)
            at = retry_of.get(at)
        own = [ev for call_id in reversed(chain) for ev in by_call.get(call_id, [])]
        out[c.call_id] = [msgspec.structs.asdict(ev) for ev in own]
    return out


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None
