"""Which episode a model call belongs to: path, per-episode key, header, or none.

Precedence follows docs/architecture.md. A per-episode key only ever tags its own episode.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Awaitable, Callable, Mapping

from tracetap.proxy.errors import bad_request, forbidden, not_found, unauthorized
from tracetap.proxy.headers import EPISODE_HEADER, bearer
from tracetap.proxy.recent import Recent

_EPISODE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
KEY_PREFIX = "tt-"
# Key owners and registered ids kept in memory (least recently used dropped past that).
REMEMBERED = 100_000
# How long a miss (a key or id the database did not know) is believed without asking
# again: a wrong key retried in a loop costs one query a second, not one per request.
MISS_SECONDS = 1.0


def validate_episode_id(value: str) -> str:
    if not isinstance(value, str) or not _EPISODE_ID.fullmatch(value):
        shown = repr(value)[:80]
        raise bad_request(
            f"invalid episode id {shown}: use 1-128 characters of A-Z a-z 0-9 . _ : -",
            "invalid_episode_id",
        )
    return value


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Tagger:
    """Resolves a request's episode; caches key owners and registered ids in memory.

    The database is asked only on a cache miss (a key or id minted by another worker or
    replica), so tagged calls never wait on it in the common case; misses are remembered
    for MISS_SECONDS. Keys are random, so a remembered miss never hides a key minted since;
    an id registered elsewhere within MISS_SECONDS of a refused call may be refused for that
    long (--require-registered only).
    """

    def __init__(
        self,
        *,
        key_owner: Callable[[str], Awaitable[str | None]],
        is_registered: Callable[[str], Awaitable[bool]],
        require_episode: bool,
        require_registered: bool,
    ):
        self._key_owner = key_owner
        self._is_registered = is_registered
        self.require_episode = require_episode
        self.require_registered = require_registered
        self._keys: Recent[str, str] = Recent(REMEMBERED)
        self._registered: Recent[str, bool] = Recent(REMEMBERED)
        self._misses: Recent[str, float] = Recent(REMEMBERED)  # key hash or id: until when

    def remember(self, episode_id: str, key_hash: str | None) -> None:
        self._registered.put(episode_id, True)
        if key_hash:
            self._keys.put(key_hash, episode_id)

    async def episode_for(self, headers: Mapping[str, str], path_episode: str | None) -> str | None:
        key = bearer(headers)
        key_episode = None
        if key and key.startswith(KEY_PREFIX):
            key_episode = await self._owner(key)
            if key_episode is None:
                raise unauthorized("unknown tracetap episode key")
        header_episode = headers.get(EPISODE_HEADER)
        episode = path_episode or key_episode or header_episode
        if episode is None:
            if self.require_episode:
                raise bad_request(
                    "this proxy requires an episode: use /episodes/<id>/v1 as the base URL, "
                    f"an episode API key, or the {EPISODE_HEADER} header",
                    "episode_required",
                )
            return None
        validate_episode_id(episode)
        named = {e for e in (path_episode, header_episode) if e is not None}
        if key_episode is not None and named - {key_episode}:
            raise forbidden("this API key belongs to another episode")
        registered = key_episode is not None or not self.require_registered
        if not registered and not await self._registered_id(episode):
            raise not_found(f"episode {episode!r} is not registered (--require-registered)")
        return episode

    async def _owner(self, key: str) -> str | None:
        digest = hash_key(key)
        owner = self._keys.get(digest)
        if owner is None and not self._missed(digest):
            owner = await self._key_owner(digest)
            if owner is None:
                self._misses.put(digest, time.monotonic() + MISS_SECONDS)
            else:
                self._keys.put(digest, owner)
        return owner

    async def _registered_id(self, episode: str) -> bool:
        if self._registered.get(episode):
            return True
        if self._missed(episode):
            return False
        if await self._is_registered(episode):
            self._registered.put(episode, True)
            return True
        self._misses.put(episode, time.monotonic() + MISS_SECONDS)
        return False

    def _missed(self, name: str) -> bool:
        until = self._misses.get(name)
        return until is not None and time.monotonic() < until
