"""Decode an agent's prompt ids in the new tokens only.

An agent's next call sends the same conversation plus one turn, so the engine's
``prompt_token_ids`` for it start with the previous call's, byte for byte (the engine
writes ids the same way every time). ``PromptPrefixes`` keeps each episode's last prompt
ids, as the engine's bytes and decoded; a call whose array extends them decodes only
what follows (a memcmp and a list copy for the rest), and its list shares the earlier
ints. Anything else (another episode, an edited history, other spacing) decodes whole.
"""

from __future__ import annotations

from collections import OrderedDict

from tracetap.proxy.prompt_cut import decode_ids

MAX_TOKENS = 2_000_000  # held across episodes (~45 bytes a token): oldest dropped first


class PromptPrefixes:
    """Per proxy process: each recent episode's last prompt ids (bytes, decoded)."""

    def __init__(self, max_tokens: int = MAX_TOKENS):
        self.max_tokens = max_tokens
        self._last: OrderedDict[str, tuple[bytes, list[int]]] = OrderedDict()
        self._tokens = 0
        self.extended = 0  # calls decoded in their new tokens only (for tests and metrics)

    def decode(self, episode_id: str | None, raw: bytes) -> list[int]:
        """``raw`` (a JSON array of ints, ``prompt_cut``'s) as a list; raises msgspec
        errors when it is not one."""
        if episode_id is None:
            return decode_ids(raw)
        last = self._last.pop(episode_id, None)
        ids = None
        if last is not None:
            self._tokens -= len(last[1])
            ids = _extend(last, raw)
        if ids is None:
            ids = decode_ids(raw)
        else:
            self.extended += 1
        self._last[episode_id] = (raw, ids)
        self._tokens += len(ids)
        while self._tokens > self.max_tokens and len(self._last) > 1:
            _, (_, dropped) = self._last.popitem(last=False)
            self._tokens -= len(dropped)
        return ids


def _extend(last: tuple[bytes, list[int]], raw: bytes) -> list[int] | None:
    """The ids of ``raw`` when it is ``last``'s array with more ids after them."""
    last_raw, last_ids = last
    head = len(last_raw) - 1  # without its "]"
    if head < 2 or last_raw[head - 1 : head] == b"[":
        return None  # an empty array: nothing to share
    if raw == last_raw:
        return list(last_ids)
    # Same bytes up to the old "]", and a comma where it was: the old ids, then more.
    # startswith on a view: one memcmp, no copy of either array
    if raw[head : head + 1] != b"," or not raw.startswith(memoryview(last_raw)[:head]):
        return None
    return last_ids + decode_ids(b"[" + raw[head + 1 :])
