"""Opt-in history repair: give the engine the model's own earlier turns back.

When an episode has repair on (``--repair-history``, or ``"repair_history": true`` at
registration), the proxy remembers each assistant reply of the episode as the engine
returned it. In a later request, an assistant message that is **equal after
normalisation** to one of them (``exporters.history``: tool arguments equal as JSON values,
whitespace at the ends, text parts instead of a string, tool calls written out as text)
but not identical is replaced by the remembered original before the request goes
upstream. The engine then renders what the model actually produced, so the prompt
extends the earlier prompt + completion token for token and the episode stays one
trajectory. The harness never sees a difference: only the upstream request changes; the
call stores both (``request`` as the harness sent it, ``upstream_request`` as the engine
got it).

Never repaired: anything that is not equal after normalisation (an edited turn, a
dropped turn, a summary, other reasoning), and a message that two different remembered
turns both normalise to (tracetap does not guess which one the harness meant).
Only chat-shaped upstream requests (chat completions, and APIs translated to chat).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from tracetap.exporters.history import Turn, equivalent, turn, turn_cause
from tracetap.proxy.apis import Reassembly

MAX_EPISODES = 10_000  # episodes remembered; the least recently used are forgotten
MAX_TURNS = 1024  # remembered replies per episode


def _key(t: Turn) -> tuple:
    return (t.text.strip(), tuple((c.name, c.value) for c in t.calls), t.reasoning)


class _Memory:
    """One episode's replies: exact forms, and the forms under each normalised key."""

    def __init__(self) -> None:
        self.exact: dict[Turn, dict[str, Any]] = {}
        self.by_key: dict[tuple, dict[Turn, dict[str, Any]]] = {}
        self.with_calls: list[Turn] = []  # for tool calls written out as text

    def add(self, message: dict[str, Any]) -> None:
        t = turn(message)
        if t in self.exact or len(self.exact) >= MAX_TURNS:
            return
        self.exact[t] = message
        self.by_key.setdefault(_key(t), {})[t] = message
        if t.calls:
            self.with_calls.append(t)

    def original(self, resent: Turn) -> Turn | None:
        """The one remembered turn ``resent`` is a reformatting of, if there is one."""
        if resent in self.exact:
            return None  # the model's own turn, as it was
        forms = list(self.by_key.get(_key(resent), ()))
        if not forms and not resent.calls:
            forms = [t for t in self.with_calls if equivalent(t, resent)]
        if len(forms) != 1:
            return None  # none, or ambiguous
        return forms[0] if equivalent(forms[0], resent) else None


class Repair:
    """Per proxy process: which episodes repair, and what their model said."""

    def __init__(self, default: bool, repaired: Callable[[str], None] | None = None):
        self.default = default
        self.on_repaired = repaired
        self._enabled: dict[str, bool] = {}
        self._memory: OrderedDict[str, _Memory] = OrderedDict()

    def enable(self, episode_id: str, on: bool) -> None:
        self._enabled[episode_id] = on
        if len(self._enabled) > MAX_EPISODES:
            del self._enabled[next(iter(self._enabled))]

    def enabled(self, episode_id: str | None) -> bool:
        return episode_id is not None and self._enabled.get(episode_id, self.default)

    def apply(self, episode_id: str | None, chat: bool, payload: dict[str, Any]) -> bool:
        """Replace reformatted copies of the model's turns in ``payload`` (in place, when
        it is ``chat``: sent to the engine as chat messages); True if any was replaced."""
        if not chat or not self.enabled(episode_id):
            return False
        memory = self._memory.get(episode_id)
        messages = payload.get("messages")
        if memory is None or not isinstance(messages, list):
            return False
        changed = False
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") != "assistant":
                continue
            resent = turn(message)
            original = memory.original(resent)
            if original is None:
                continue
            messages[i] = copy.deepcopy(memory.exact[original])
            changed = True
            if self.on_repaired is not None:
                self.on_repaired(turn_cause(original, resent) or "unknown")
        return changed

    def remember(self, episode_id: str | None, chat: bool, ok: bool,
                 capture: Reassembly) -> None:
        """Keep the replies of a finished call of a repairing episode: its reassembled
        choices, read only when they are kept (a chat call that succeeded)."""
        if not self.enabled(episode_id) or not chat or not ok:
            return
        memory = self._memory.pop(episode_id, None) or _Memory()
        self._memory[episode_id] = memory  # most recently used last
        if len(self._memory) > MAX_EPISODES:
            self._memory.popitem(last=False)
        for choice in capture.reassembled(with_logprobs=False)["choices"]:
            message = choice.get("message")
            if not isinstance(message, dict) or not (message.get("content")
                                                     or message.get("tool_calls")):
                continue
            original = {"role": "assistant", "content": message.get("content")}
            for key in ("tool_calls", "reasoning_content"):
                if message.get(key):
                    original[key] = message[key]
            memory.add(original)
