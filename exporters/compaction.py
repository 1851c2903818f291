"""Compacted conversations → linked segments of one episode (export time).

A harness that compacts its context (Claude Code's ``/compact`` and auto-compact, Codex's
auto-compaction, any summariser of old turns) asks the model for a summary, then goes on
with a history that starts over: the summary in place of the old turns. The next call's
prompt extends no earlier context, so its row is a new root of the prefix forest
(``non_prefix``), or, when the harness also changed its system prompt, the first row of
a new lineage. Neither says what happened.

A compaction is told apart by the text: the new segment's first call (its *start*) is
sent a text that an earlier call of the episode sampled (the *summary*). Of the calls
that finished before the start began, the nearest ``LOOKBACK`` are read, nearest first;
the first whose reply text (at least ``MIN_CHARS`` of it, stripped) appears in what the
start's request says outside the assistant's turns (whole, or for a long summary one of
its ``WINDOW``-character pieces, its end among them: a harness may keep only part of it,
as Claude Code keeps the ``<summary>`` and drops the ``<analysis>`` before it) is the
summary call.

Then, for each compaction found (``relink``):

- the summary call is a lineage of its own, under the conversation it summarised, so its
  row is that lineage's main line: its completion is trained once, like any other;
- a start that began a lineage of its own (a system prompt that changed at the
  compaction) is merged back into the lineage it continues;
- a summary links only the first start told it (it stays in every later prompt of the
  segment, whose own splits are not compactions);
- the start's row says ``split_reason = "compaction"``, ``summary_call_id`` (the call that
  wrote the summary) and ``continues_trajectory_id``: the row of the same lineage whose
  last call is the latest to finish before the summary call started (the context that was
  summarised; the main line on a tie).

The token arithmetic is the prefix forest's (``exporters.trajectories``): moving a call to
a lineage of its own changes which row trains its tokens, never how many times.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, NamedTuple

from tracetap.exporters.drift import json_body, reply_message
from tracetap.exporters.history import text_of
from tracetap.exporters.lineages import Lineage
from tracetap.exporters.trajectories import Trajectory

LOOKBACK = 16  # earlier calls read per start, nearest first
MIN_CHARS = 12  # a shorter reply ("OK", "Done.") is no evidence of a summary
WINDOW = 64  # a long summary is found by any one of its pieces this long
_PIECES = 8  # pieces tried per summary, spread over it (and its end)

Build = Callable[..., list[Trajectory]]  # lineages= → the episode's rows
Bodies = Callable[[list[str]], Awaitable[Mapping[str, Any]]]


class Compaction(NamedTuple):
    start: str  # call id: the first call of the segment after the compaction
    summary: str  # call id: the call whose reply is the summary


async def segments(calls: Sequence[Any], rows: list[Trajectory], lineages: dict[str, Lineage],
                   build: Build, bodies: Bodies) -> list[Trajectory]:
    """``rows`` (one episode's, built with ``lineages``) with its compactions linked:
    ``lineages`` updated for the episode's calls and the rows rebuilt when one is found.
    ``calls`` are the episode's calls (t_start, t_end, status, call_id); ``bodies`` reads
    the request and response of the calls named."""
    starts = _candidates(rows, lineages)
    if not starts:
        return rows
    found = await _found(calls, starts, bodies)
    if not found:
        return rows
    relink(found, lineages, [c.call_id for c in calls])
    rows = build(lineages=lineages)
    mark(rows, found, lineages, {c.call_id: c for c in calls})
    return rows


async def _found(calls: Sequence[Any], starts: list[str], bodies: Bodies) -> list[Compaction]:
    """The compactions among ``starts``, in arrival order (module doc)."""
    position = {c.call_id: i for i, c in enumerate(sorted(calls, key=_arrival))}
    finished = sorted((c for c in calls if c.status == "ok" and c.t_end is not None),
                      key=lambda c: c.t_end)
    ends = [c.t_end for c in finished]
    begun = {c.call_id: c.t_start for c in calls}
    earlier = {}
    for start in starts:  # the nearest LOOKBACK calls that finished before it began
        at = bisect_right(ends, begun[start])
        earlier[start] = [c.call_id for c in reversed(finished[max(0, at - LOOKBACK - 1):at])
                          if c.call_id != start][:LOOKBACK]
    read = await bodies(sorted({*starts, *(i for s in starts for i in earlier[s])}))
    texts = {i: _sampled(json_body(getattr(read.get(i), "response", None)))
             for i in {i for s in starts for i in earlier[s]}}
    found: list[Compaction] = []
    for start in sorted(starts, key=position.__getitem__):
        summary = find(read.get(start), [(i, texts[i]) for i in earlier[start]])
        # The summary stays in every later prompt of the segment: a later split there
        # (template drift, a dropped turn) is not another compaction.
        if summary is not None and all(f.summary != summary for f in found):
            found.append(Compaction(start, summary))
    return found


def _arrival(call: Any) -> tuple:
    return call.t_start, getattr(call, "instance", ""), getattr(call, "seq", 0)


def bodies_of(reader: Any, calls: Sequence[Any]) -> Bodies:
    """How ``segments`` reads bodies: from the calls when the scan brought them, else
    from the reader (storage.scan.Reader.bodies)."""
    if reader.with_bodies:
        async def given(ids: list[str]) -> Mapping[str, Any]:
            return {c.call_id: c for c in calls}
        return given
    return reader.bodies


def _candidates(rows: list[Trajectory], lineages: Mapping[str, Lineage]) -> list[str]:
    """First calls of rows that may follow a compaction: a new root of the forest, or the
    first row of a lineage that something else started."""
    starts = []
    for row in rows:
        first = row.call_ids[0]
        lineage = lineages.get(first)
        if row.split_reason == "non_prefix" or (
                row.split_reason is None and lineage is not None and lineage.id == first
                and lineage.parent is not None):
            starts.append(first)
    return starts


def find(start: Any, earlier: Sequence[tuple[str, str]]) -> str | None:
    """The id of the first of ``earlier`` (call id, the text its reply holds; nearest
    first) whose text the ``start`` call's request (a body with ``request``) was sent;
    None if none was."""
    told = _told(json_body(getattr(start, "request", None)))
    if not told:
        return None
    for call_id, text in earlier:
        if len(text) >= MIN_CHARS and _contains(told, text):
            return call_id
    return None


def _contains(told: str, text: str) -> bool:
    if len(text) <= WINDOW:
        return text in told
    last = len(text) - WINDOW  # its end too: a harness may keep only the summary's tail
    step = max(WINDOW, last // _PIECES)
    return any(text[at:at + WINDOW] in told for at in (*range(0, last, step), last))


def _sampled(response: dict[str, Any] | None) -> str:
    """The text the model wrote in a reply (chat, Messages, Responses), stripped."""
    message = reply_message(response, 0) if response else None
    content = message.get("content") if message else None
    return content.strip() if isinstance(content, str) else ""


def _told(request: dict[str, Any] | None) -> str:
    """What a request says outside the assistant's turns: system prompt, instructions,
    user and tool messages (chat, Messages, Responses)."""
    if request is None:
        return ""
    items = request.get("messages")
    if items is None:
        items = request.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    texts = [_flat(request.get("system")), _flat(request.get("instructions"))]
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, Mapping) or item.get("role") == "assistant" or item.get(
                "type") in ("function_call", "reasoning"):
            continue
        texts.append(_flat(item.get("content", item.get("output"))))
    return "\n".join(t for t in texts if t)


def _flat(value: Any) -> str:
    """Every text in a content value: a string, text parts, tool results' content."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(_flat(v) for v in value)
    if isinstance(value, Mapping):
        text = value.get("text")
        if isinstance(text, str):
            return text
        return _flat(value.get("content"))
    text, _ = text_of(value)
    return text


def relink(found: Sequence[Compaction], lineages: dict[str, Lineage],
           ordered: Sequence[str]) -> None:
    """Each summary call a lineage of its own under the one it summarised; a start's
    lineage that began with it merged into the lineage it continues (module doc)."""
    for compaction in found:
        start = lineages.get(compaction.start)
        if start is None:
            continue
        continued = start
        if start.id == compaction.start and start.parent is not None:
            continued = next((lineage for lineage in lineages.values()
                              if lineage.id == start.parent), start)
            for call_id in ordered:
                if lineages.get(call_id) is start:
                    lineages[call_id] = continued
        summary = lineages.get(compaction.summary)
        if summary is continued or summary is start:
            lineages[compaction.summary] = Lineage(id=compaction.summary, parent=continued.id,
                                                   starts=set())


def mark(rows: list[Trajectory], found: Sequence[Compaction],
         lineages: Mapping[str, Lineage], calls: Mapping[str, Any]) -> None:
    """The start's row: its split reason, summary call and the row it continues."""
    for compaction in found:
        row = next((r for r in rows if r.call_ids[0] == compaction.start
                    and r.split_reason == "non_prefix"), None)
        summary = calls.get(compaction.summary)
        if row is None or summary is None:
            continue
        row.split_reason = "compaction"
        row.summary_call_id = compaction.summary
        lineage = lineages.get(compaction.start)
        best, best_key = None, None
        for other in rows:
            leaf = calls.get(other.call_ids[-1])
            if (other is row or lineages.get(other.call_ids[-1]) is not lineage
                    or leaf is None or leaf.t_end is None or leaf.t_end > summary.t_start):
                continue
            key = (leaf.t_start, other.split_reason in (None, "compaction"))
            if best_key is None or key > best_key:
                best, best_key = other, key
        row.continues_trajectory_id = best.trajectory_id if best else None
