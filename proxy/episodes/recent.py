"""A dict that keeps only its most recently used entries."""

from __future__ import annotations

from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Recent(Generic[K, V]):
    """At most ``size`` entries; past that the least recently used one is dropped, so a
    proxy serving millions of episodes does not keep one entry for each forever."""

    def __init__(self, size: int):
        self.size = size
        self._items: dict[K, V] = {}

    def __contains__(self, key: K) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: K, default: V | None = None) -> V | None:
        value = self._items.pop(key, self)
        if value is self:
            return default
        self._items[key] = value  # re-inserted last: the dict's order is recency
        return value

    def put(self, key: K, value: V) -> None:
        self._items.pop(key, None)
        self._items[key] = value
        if len(self._items) > self.size:
            del self._items[next(iter(self._items))]
