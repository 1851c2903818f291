"""Decode an agent's prompt ids in the new tokens only.

An agent's next call sends the same conversation plus one turn, so the engine's
``prompt_token_ids`` for it start with the previous call's, byte for byte (the engine
writes ids the same way every time). ``PromptPrefixes`` keeps each episode's last prompt
ids as the engine's bytes and packed as storage keeps them (int32); a call whose array
extends them decodes and packs only what follows (a memcmp, then a bytes join for the
rest), and never makes a list of the whole prompt: the record carries the packed bytes
(``CallRecord.prompt_ids_packed``), which the journal and the writer use as they are.
Anything else (another episode, an edited history, other spacing) decodes whole. A
prompt with an id outside int32 cannot be packed: it is kept as a list, as before.

Bounded: an episode's entry goes when the episode is finished (``forget``), and the
oldest go first past ``max_bytes`` (about 10 bytes a token held: the engine's bytes and
the packed copy).
"""

from __future__ import annotations

import struct
from collections import OrderedDict

from tracetap.proxy.apis.chat.prompt_cut import decode_ids
from tracetap.storage.codec import pack_ids, unpack_ids

MAX_BYTES = 32 << 20  # held across episodes: ~3M tokens of context in flight
_LIST_TOKEN = 40  # bytes a token of a kept list holds, about (slot and int object)

# (the engine's bytes, the packed ids, or the list when they cannot be packed)
_Entry = tuple[bytes, bytes | None, list[int] | None]


class PromptPrefixes:
    """Per proxy process: each recent episode's last prompt ids (the engine's bytes, packed)."""

    def __init__(self, max_bytes: int = MAX_BYTES):
        self.max_bytes = max_bytes
        self._last: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self.extended = 0  # calls decoded in their new tokens only (for tests and metrics)

    @property
    def held_bytes(self) -> int:
        """What the entries hold, about (the cap's measure)."""
        return self._bytes

    def decode(self, episode_id: str | None, raw: bytes) -> list[int]:
        """``raw`` (a JSON array of ints, ``prompt_cut``'s) as a list; raises msgspec
        errors when it is not one."""
        ids, packed = self.decode_packed(episode_id, raw)
        return ids if ids is not None else unpack_ids(packed)

    def decode_packed(self, episode_id: str | None, raw: bytes,
                      ) -> tuple[list[int] | None, bytes | None]:
        """``raw``'s ids as ``(None, packed int32 bytes)``, or ``(list, None)`` when one
        does not fit int32 (storage then says so, as for any record)."""
        if episode_id is None:
            return _whole(raw)
        last = self._last.pop(episode_id, None)
        got = None
        if last is not None:
            self._bytes -= _size(last)
            got = _extend(last, raw)
        if got is None:
            got = _whole(raw)
        else:
            self.extended += 1
        entry = (raw, got[1], got[0])
        if _size(entry) <= self.max_bytes:
            self._last[episode_id] = entry
            self._bytes += _size(entry)
        while self._bytes > self.max_bytes:
            self._bytes -= _size(self._last.popitem(last=False)[1])
        return got

    def forget(self, episode_id: str) -> None:
        """The episode is finished: no call of it will extend its prompt again."""
        last = self._last.pop(episode_id, None)
        if last is not None:
            self._bytes -= _size(last)


def _size(entry: _Entry) -> int:
    raw, packed, ids = entry
    return len(raw) + len(packed or b"") + _LIST_TOKEN * len(ids or ())


def _whole(raw: bytes) -> tuple[list[int] | None, bytes | None]:
    ids = decode_ids(raw)
    try:
        return None, pack_ids(ids)
    except struct.error:  # an id outside int32: the record keeps the list
        return ids, None


def _extend(last: _Entry, raw: bytes) -> tuple[list[int] | None, bytes | None] | None:
    """The ids of ``raw`` when it is ``last``'s array with more ids after them."""
    last_raw, last_packed, last_ids = last
    head = len(last_raw) - 1  # without its "]"
    if head < 2 or last_raw[head - 1 : head] == b"[":
        return None  # an empty array: nothing to share
    if raw == last_raw:
        return (None, last_packed) if last_ids is None else (list(last_ids), None)
    # Same bytes up to the old "]", and a comma where it was: the old ids, then more.
    # startswith on a view: one memcmp, no copy of either array
    if raw[head : head + 1] != b"," or not raw.startswith(memoryview(last_raw)[:head]):
        return None
    new = decode_ids(b"[" + raw[head + 1 :])
    if last_ids is None:
        try:
            return None, last_packed + pack_ids(new)
        except struct.error:
            last_ids = unpack_ids(last_packed)
    return last_ids + new, None
