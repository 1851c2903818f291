"""Calls of one episode → lineages: the conversations inside it (pure: no I/O).

A coding CLI's episode holds more than one conversation: the main agent, the sub-agents
it starts, a title generator, a summariser. Each is a *lineage*; the trajectory builder
merges each lineage's calls on its own (``exporters.trajectories``), so a sub-agent's
turns become rows of their own instead of ``non_prefix`` splits of the main line.

A lineage's id is the call id of its first call (stable across export runs); its parent
is the lineage that started it, None for a root. Calls are taken in arrival order:

1. a call that names its lineage (``X-Tracetap-Lineage``, proxy.episodes.lineage) joins the
   lineage of that name, or starts it; its parent is the lineage named by
   ``X-Tracetap-Parent``, else found as in 4;
2. a call without a conversation hash (a completions prompt, a relayed count_tokens, a
   row stored before revision 0010) joins the lineage of the latest call before it, or
   begins the episode's first: an episode stored before lineages existed is one lineage,
   as it exported before;
3. a call whose start (system prompt and first message, ``F``) is one a lineage already
   began with joins it (every turn of a conversation resends its start); else one whose
   system prompt (``S``) is a lineage's, when that lineage has no call in flight as this
   one starts, joins the most recent such lineage: the conversation rewrote its history
   (a summary in place of old turns; the row splits as ``non_prefix`` there, with its
   drift cause, as before). A conversation never rewrites itself while its own call is
   in flight, so parallel sub-agents of one type stay apart;
4. otherwise it starts a new lineage. Its parent is the lineage of the latest call that
   finished, before it started, asking for a tool (the call that spawned it: a Task tool,
   a handoff), else the lineage of the latest call started before it (the one active)
   when that lineage is a conversation (more than one call so far), else none: a one-shot
   side call (opencode's title, Claude Code's quota check), often the episode's first,
   parents nothing, so the main conversation after it is a root too.

Detection can be wrong where a harness gives no sign: two sub-agents with one system
prompt started one after the other join one lineage (as rewrites); the headers say it
exactly.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

# Finish reasons of a reply that asked for a tool (chat, Anthropic Messages, Responses).
TOOL_FINISH = frozenset({"tool_calls", "tool_use", "function_call"})


class CallView(msgspec.Struct, kw_only=True, gc=False):
    """What lineage assignment reads of a call."""

    call_id: str
    t_start: float
    t_end: float | None = None
    conversation: str | None = None
    lineage: str | None = None  # the harness's name (X-Tracetap-Lineage)
    parent_lineage: str | None = None  # X-Tracetap-Parent
    asked_tool: bool = False  # a choice finished asking for a tool


class Lineage(msgspec.Struct, kw_only=True, gc=False):
    id: str
    parent: str | None = None
    system: str | None = None
    starts: set[str] = set()
    busy_until: float = float("-inf")  # the latest end of its calls so far


def assign(calls: Iterable[CallView]) -> dict[str, Lineage]:
    """Each call id's lineage (calls in arrival order)."""
    of: dict[str, Lineage] = {}
    named: dict[str, Lineage] = {}
    by_start: dict[str, Lineage] = {}
    order: list[Lineage] = []  # lineages by their latest call, most recent last
    history: list[tuple[CallView, Lineage]] = []
    for call in calls:
        if call.lineage is not None:
            found = named.get(call.lineage)
            if found is None:
                parent = named.get(call.parent_lineage) if call.parent_lineage else None
                found = named[call.lineage] = _new(call, parent.id if parent else
                                                   _parent(call, history))
        elif call.conversation is None:
            found = history[-1][1] if history else _new(call, None)
        else:
            found = _detected(call, by_start, order, history)
        _joined(found, call, by_start, order)
        of[call.call_id] = found
        history.append((call, found))
    return of


def _detected(call: CallView, by_start: dict[str, Lineage], order: list[Lineage],
              history: list[tuple[CallView, Lineage]]) -> Lineage:
    system, _, start = call.conversation.partition(":")
    found = by_start.get(start)
    if found is not None:
        return found
    for lineage in reversed(order):
        if lineage.system == system and lineage.busy_until <= call.t_start:
            return lineage
    found = _new(call, _parent(call, history))
    found.system = system
    return found


def _joined(lineage: Lineage, call: CallView, by_start: dict[str, Lineage],
            order: list[Lineage]) -> None:
    if call.conversation is not None:
        system, _, start = call.conversation.partition(":")
        lineage.system = lineage.system or system
        if start not in lineage.starts:
            lineage.starts.add(start)
            by_start.setdefault(start, lineage)
    if call.t_end is not None and call.t_end > lineage.busy_until:
        lineage.busy_until = call.t_end
    if order and order[-1] is lineage:
        return
    order[:] = [other for other in order if other is not lineage]  # by identity
    order.append(lineage)


def _new(call: CallView, parent: str | None) -> Lineage:
    return Lineage(id=call.call_id, parent=parent, starts=set())


def _parent(call: CallView, history: list[tuple[CallView, Lineage]]) -> str | None:
    """The lineage that started ``call`` (rule 4 above)."""
    for earlier, lineage in reversed(history):
        if earlier.asked_tool and earlier.t_end is not None and earlier.t_end <= call.t_start:
            return lineage.id
    if not history:
        return None
    active = history[-1][1]
    calls = sum(1 for _, lineage in history if lineage is active)
    return active.id if calls > 1 else None
