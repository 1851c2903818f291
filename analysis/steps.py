"""An episode's steps rebuilt across all of its calls, not from the last request alone.

A harness that compacts or summarises its history resends less than happened, so the
last request no longer holds every step. Instead, each answered call's reply is one
action (linked to that call), and the observations that followed it are the messages
the *next* call added after its last assistant turn: tool results, user turns, or, when
the harness dropped its turns, the summary it sent instead. The first call's history
(what happened before any captured call) is read as analysis.conversation reads one
request.

Each call is read as the model was given it (``upstream_request``, when the proxy or an
overlay changed it). What is there but not in what the harness sent (``request``) was
added by an overlay (docs/overlays.md: an injected reminder, a vetoed turn and its
feedback): such an observation is marked ``injected``, such an assistant turn (a vetoed
attempt kept in context) is no action of the harness and is left out. The comparison is
by content, so a call the proxy translated between APIs reads the same on both sides.

A vetoed attempt (status ``vetoed``) is skipped: its reply never reached the harness, and
the attempt after it carries the same request.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec

from tracetap.analysis.conversation import (
    Step,
    Task,
    action,
    conversation_of,
    cut,
    final_message,
    messages_of,
    observations,
    text,
    tool,
)
from tracetap.storage.conversation import SYSTEM_ROLES, Message, Readers, ToolCall

_WHOLE = 1 << 62  # a budget nothing reaches: texts compared before they are cut


class CallBodies(msgspec.Struct, kw_only=True, gc=False):
    """One call as the steps are read from it."""

    call_id: str
    endpoint: str  # calls.endpoint: which API's reader reads the bodies
    status: str = "ok"
    failed: bool = False
    request: str | None = None
    upstream_request: str | None = None
    response: str | None = None


def read_steps(readers: Readers, calls: list[CallBodies],
               budget: int) -> tuple[Task, list[Step], list[dict]]:
    """The task (from the first call), the steps, and what an overlay injected before the
    first step (observations of no step); each call read by its API's reader."""
    task, steps, before = Task(), [], []
    names: dict[Any, Any] = {}  # tool call id -> tool name
    pending = False  # the last step's observations come from the next call's request
    first = True
    for call in calls:
        if call.status == "vetoed":
            continue
        harness = messages_of(readers, call.endpoint, call.request)
        model = None
        if call.upstream_request:  # the proxy or an overlay changed what the model got
            model = messages_of(readers, call.endpoint, call.upstream_request, upstream=True)
        marked = _marked(harness, None) if model is None else _marked(model, harness)
        if first:
            task = Task(tools=[tool(t) for t in conversation_of(
                readers, call.endpoint, call.request, call.upstream_request).tools])
            _history(marked, task, steps, before, names, budget)
            first = False
        elif pending and steps:
            steps[-1].observations += _trailing(marked, task, names, budget)
        pending = False
        final = None if call.failed else final_message(readers, call.endpoint, call.response)
        if final is not None:
            step = action(final, len(steps), names, budget)
            step.call_id = call.call_id
            steps.append(step)
            pending = True
    return task, steps, before


def _marked(messages: list[Message], harness: list[Message] | None) -> list[tuple]:
    """Each message with, per observation it holds (one flag for any other message),
    whether an overlay added it: absent from the harness's own messages (``harness``
    None: the model was given the harness's request as it is). Observations are compared
    one by one, so a user turn of several tool results (Messages) matches the tool
    messages chat spells them as."""
    if harness is None:
        return [(m, [False] * len(_keys(m))) for m in messages]
    sent = Counter(k for m in harness for k in _keys(m))
    out = []
    for m in messages:
        flags = []
        for key in _keys(m):
            ours = sent[key] > 0
            sent[key] -= ours
            flags.append(not ours)
        out.append((m, flags))
    return out


def _keys(m: Message) -> list[tuple]:
    """A message by content, whichever API spelled it: one key per observation."""
    if m.role == "assistant":
        calls = [c.name for c in m.parts if type(c) is ToolCall]
        return [("assistant", text(m), tuple(calls))]
    if m.role in ("user", "tool"):
        return [("observation", o["content"]) for o in observations(m, {}, _WHOLE)]
    return [(m.role, text(m))]


def _added(flags: list[bool]) -> bool:
    """The whole message was added by an overlay."""
    return bool(flags) and all(flags)


def _history(marked, task: Task, steps: list[Step], before: list, names, budget) -> None:
    """The first call's conversation, as analysis.conversation.read reads a request."""
    for m, flags in marked:
        role, injected = m.role, _added(flags)
        if role in SYSTEM_ROLES and not steps and not injected:
            if task.system is None:
                task.system = cut(text(m), budget)
        elif role == "assistant":
            if not injected:
                steps.append(action(m, len(steps), names, budget))
        elif role == "user" and task.user is None and not steps and not injected:
            task.user = cut(text(m), budget)
        elif role in ("user", "tool", "system", "developer"):
            seen = _observed(m, flags, names, budget)
            (steps[-1].observations if steps else before).extend(seen)


def _trailing(marked, task: Task, names, budget) -> list[dict]:
    """What a request added after its last assistant turn of the harness's own; with no
    such turn (the harness dropped or summarised them), everything after the leading
    system messages but the task itself."""
    last = max(
        (i for i, (m, flags) in enumerate(marked) if m.role == "assistant" and not _added(flags)),
        default=None,
    )
    if last is None:
        start = 0
        while start < len(marked) and marked[start][0].role in SYSTEM_ROLES:
            start += 1
        rest = [
            (m, flags)
            for m, flags in marked[start:]
            if not (m.role == "user" and cut(text(m), budget) == task.user)
        ]
    else:
        rest = marked[last + 1 :]
    out = []
    for m, flags in rest:
        if m.role != "assistant":  # an injected assistant turn: a vetoed attempt
            out += _observed(m, flags, names, budget)
    return out


def _observed(m: Message, flags: list[bool], names, budget) -> list[dict]:
    if m.role in SYSTEM_ROLES:
        found = [{"source": "system", "name": None, "content": cut(text(m), budget)}]
    else:
        found = observations(m, names, budget)
    if len(flags) != len(found):
        flags = [_added(flags)] * len(found)
    return [{**o, "injected": flag} for o, flag in zip(found, flags, strict=True)]
