"""Decode an agent's prompt ids in the new tokens only.

An agent's next call sends the same conversation plus one turn, so the engine's
``prompt_token_ids`` for it start with the previous call's, byte for byte (the engine
writes ids the same way every time). ``PromptPrefixes`` keeps each episode's last prompt
ids, as the engine's bytes, decoded and packed as storage keeps them (int32); a call
whose array extends them decodes and packs only what follows (a memcmp, a list copy and
a bytes join for the rest), and its list shares the earlier ints. Anything else (another
episode, an edited history, other spacing) decodes whole. The packed bytes go with the
record (``CallRecord.prompt_ids_packed``): the journal and the writer use them as they are.

Bounded: an episode's entry goes when the episode is finished (``forget``), and the
oldest go first past ``max_bytes`` (about 50 bytes a token held: the engine's bytes, the
list and its new ints, the packed copy).
"""

from __future__ import annotations

import struct
from collections import OrderedDict

from tracetap.proxy.prompt_cut import decode_ids
from tracetap.storage.codec import pack_ids

MAX_BYTES = 48 << 20  # held across episodes: ~1M tokens of context in flight
_PER_TOKEN = 50  # bytes, about: raw JSON ~6, list slot 8, int object ~32, packed 4


class PromptPrefixes:
    """Per proxy process: each recent episode's last prompt ids (bytes, decoded, packed)."""

    def __init__(self, max_bytes: int = MAX_BYTES):
        self.max_bytes = max_bytes
        self._last: OrderedDict[str, tuple[bytes, list[int], bytes | None]] = OrderedDict()
        self._bytes = 0
        self.extended = 0  # calls decoded in their new tokens only (for tests and metrics)

    @property
    def held_bytes(self) -> int:
        """What the entries hold, about (the cap's measure)."""
        return self._bytes

    def decode(self, episode_id: str | None, raw: bytes) -> list[int]:
        """``raw`` (a JSON array of ints, ``prompt_cut``'s) as a list; raises msgspec
        errors when it is not one."""
        return self.decode_packed(episode_id, raw)[0]

    def decode_packed(self, episode_id: str | None, raw: bytes,
                      ) -> tuple[list[int], bytes | None]:
        """``decode``, and the ids packed as storage keeps them (None when one does not
        fit int32: storage then says so, as for any record)."""
        if episode_id is None:
            ids = decode_ids(raw)
            return ids, _pack(ids)
        last = self._last.pop(episode_id, None)
        got = None
        if last is not None:
            self._bytes -= _size(last)
            got = _extend(last, raw)
        if got is None:
            ids = decode_ids(raw)
            got = ids, _pack(ids)
        else:
            self.extended += 1
        entry = (raw, *got)
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


def _size(entry: tuple[bytes, list[int], bytes | None]) -> int:
    return len(entry[0]) + _PER_TOKEN * len(entry[1])


def _pack(ids: list[int]) -> bytes | None:
    try:
        return pack_ids(ids)
    except struct.error:  # an id outside int32: the record keeps the list alone
        return None


def _extend(last: tuple[bytes, list[int], bytes | None], raw: bytes,
            ) -> tuple[list[int], bytes | None] | None:
    """The ids of ``raw`` (and packed) when it is ``last``'s array with more ids after."""
    last_raw, last_ids, last_packed = last
    head = len(last_raw) - 1  # without its "]"
    if head < 2 or last_raw[head - 1 : head] == b"[":
        return None  # an empty array: nothing to share
    if raw == last_raw:
        return list(last_ids), last_packed
    # Same bytes up to the old "]", and a comma where it was: the old ids, then more.
    # startswith on a view: one memcmp, no copy of either array
    if raw[head : head + 1] != b"," or not raw.startswith(memoryview(last_raw)[:head]):
        return None
    new = decode_ids(b"[" + raw[head + 1 :])
    new_packed = _pack(new)
    packed = None if last_packed is None or new_packed is None else last_packed + new_packed
    return last_ids + new, packed
