"""Which episode a call belongs to: path, per-episode key, header, or none.

Precedence follows docs/architecture.md. A per-episode key only ever tags its own episode,
and a registered episode takes calls only from whoever holds its key: the key as the API
key, or inside the base URL registration hands out (``/episodes/<id>~<secret>/v1``, for
harnesses that only set a base URL). Unregistered ids stay open unless the operator
requires registration.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping

import msgspec

from tracetap.proxy.episodes.recent import Recent
from tracetap.proxy.http.errors import (
    ProxyError,
    bad_request,
    forbidden,
    not_found,
    unauthorized,
)
from tracetap.proxy.http.headers import EPISODE_HEADER, bearer

log = logging.getLogger("tracetap")

_EPISODE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
KEY_PREFIX = "tt-"
# Separates an episode id from its secret in a path: never part of an id (see _EPISODE_ID).
CAPABILITY_MARK = "~"
# Key owners and registered ids kept in memory (least recently used dropped past that).
REMEMBERED = 100_000
# How long a miss (a key or id the database did not know) is believed without asking
# again: a wrong key retried in a loop costs one query a second, not one per request.
MISS_SECONDS = 1.0
OUTAGE_LOG_SECONDS = 60.0
# How often each process reads the registrations made since its last look (any process),
# and how far back it reads again each time (commit delays, clocks of replicas that
# disagree by less than that).
FOLLOW_SECONDS = 0.5
# While registrations' notices arrive (storage.notify), the read they trigger is what keeps
# up; this slow read besides only costs an idle process CPU.
IDLE_FOLLOW_SECONDS = 30.0
FOLLOW_OVERLAP = 5.0
FOLLOW_BATCH = 10_000


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


def episode_path(episode_id: str, api_key: str) -> str:
    """The path segment that carries both the episode and its key (the key's secret part)."""
    return f"{episode_id}{CAPABILITY_MARK}{api_key.removeprefix(KEY_PREFIX)}"


def split_path_episode(segment: str | None) -> tuple[str | None, str | None]:
    """``id~secret`` → (id, the episode key); a plain id → (id, None)."""
    if segment is None or CAPABILITY_MARK not in segment:
        return segment, None
    episode_id, _, secret = segment.partition(CAPABILITY_MARK)
    return episode_id, KEY_PREFIX + secret


def credential_required(episode_id: str) -> ProxyError:
    return forbidden(
        f"episode {episode_id!r} is registered: its calls need its key (the base_url or "
        "api_key its registration returned)", "episode_credential_required")


def finished_error(episode_id: str) -> ProxyError:
    # The same words whoever asks: the reply says nothing about the episode's reward.
    return ProxyError(409, f"episode {episode_id!r} is finished: its key and id take no more "
                      "calls", "invalid_request_error", "episode_finished")


def unavailable(exc: Exception) -> ProxyError:
    return ProxyError(503, f"the episode's key cannot be checked now: {type(exc).__name__}",
                      "server_error", "database_unavailable", headers={"Retry-After": "5"})


class Tagged(msgspec.Struct, frozen=True):
    episode_id: str | None
    keyed: bool  # the request carried the episode's key (in a header or its path)


class Tagger:
    """Resolves a request's episode; caches key owners and registered ids in memory.

    The database is asked only on a cache miss (a key, or an id called without a key, that
    this process has not seen), so tagged calls do not wait on it in the common case. Keys
    are random, so a remembered miss never hides a key minted since. An id found
    unregistered is believed while ``follow`` keeps up with registrations (an id
    registered by another worker or replica is known here within FOLLOW_SECONDS), else
    for MISS_SECONDS.
    """

    def __init__(
        self,
        *,
        key_owner: Callable[[str], Awaitable[str | None]],
        is_registered: Callable[[str], Awaitable[bool]],
        require_episode: bool,
        require_registered: bool,
        is_finished: Callable[[str], Awaitable[bool]] | None = None,
    ):
        self._key_owner = key_owner
        self._is_registered = is_registered
        self._is_finished = is_finished
        # Finished episodes (by this process's admin API, ``follow_finished``, or asked
        # when a key is first seen): their keys and ids take no more calls (409).
        self._finished: Recent[str, bool] = Recent(REMEMBERED)
        self.require_episode = require_episode
        self.require_registered = require_registered
        self._keys: Recent[str, str] = Recent(REMEMBERED)
        self._registered: Recent[str, bool] = Recent(REMEMBERED)
        self._misses: Recent[str, float] = Recent(REMEMBERED)  # key hash or id: until when
        self._quiet_until = 0.0  # the next database outage warning, not before
        # True while ``follow`` keeps up with new registrations: an id found unregistered
        # is then believed until the follower says otherwise, not asked about again.
        self.following = False

    def finished(self, episode_id: str) -> None:
        """The episode was finished: a call with its key or id is refused from now on."""
        self._finished.put(episode_id, True)

    def _open(self, episode_id: str) -> None:
        if self._finished.get(episode_id):
            raise finished_error(episode_id)

    def remember(self, episode_id: str, key_hash: str | None) -> None:
        self._registered.put(episode_id, True)
        if key_hash:
            self._keys.put(key_hash, episode_id)

    async def episode_for(self, headers: Mapping[str, str], path_episode: str | None, *,
                          model_call: bool = True) -> str | None:
        return (await self.resolve(headers, path_episode, model_call=model_call)).episode_id

    async def resolve(self, headers: Mapping[str, str], path_episode: str | None, *,
                      model_call: bool = True) -> Tagged:
        """The episode of a request (None: untagged), or a ProxyError: a bad id (400), an
        unknown key (401), someone else's key or no key for a registered episode (403), an
        unregistered id under --require-registered (404). ``model_call=False`` (a relayed
        path) never requires an episode."""
        path_episode, path_key = split_path_episode(path_episode)
        key = bearer(headers)
        key_episode = None
        if key and key.startswith(KEY_PREFIX):
            key_episode = await self._owner_or_401(key)
        if path_key is not None:
            validate_episode_id(path_episode)
            path_owner = await self._owner_or_401(path_key)
            if key_episode is not None and key_episode != path_owner:
                raise forbidden("this API key belongs to another episode")
            key_episode = path_owner
        header_episode = headers.get(EPISODE_HEADER)
        episode = path_episode or key_episode or header_episode
        if episode is None:
            if self.require_episode and model_call:
                raise bad_request(
                    "this proxy requires an episode: use /episodes/<id>/v1 as the base URL, "
                    f"an episode API key, or the {EPISODE_HEADER} header",
                    "episode_required",
                )
            return Tagged(None, keyed=False)
        validate_episode_id(episode)
        named = {e for e in (path_episode, header_episode) if e is not None}
        if key_episode is not None:
            if named - {key_episode}:
                raise forbidden("this API key belongs to another episode")
            self._open(key_episode)
            return Tagged(episode, keyed=True)
        # No credential: fine for an id nobody registered, never for a registered one.
        try:
            registered = await self._registered_id(episode)
        except Exception as exc:  # the database cannot answer (a lookup's own failure)
            if self.require_registered:
                raise unavailable(exc) from exc
            # Capture keeps going through a database outage (the journal holds the
            # records); an episode this process never saw registered is taken as open,
            # and not asked about again for MISS_SECONDS (each call would wait on it).
            self._misses.put(episode, time.monotonic() + MISS_SECONDS)
            if time.monotonic() >= self._quiet_until:
                self._quiet_until = time.monotonic() + OUTAGE_LOG_SECONDS
                log.warning("could not check whether episode %r is registered (%s); taken "
                            "as not registered (said once a minute)", episode, exc)
            registered = False
        if registered:
            raise credential_required(episode)
        if self.require_registered:
            raise not_found(f"episode {episode!r} is not registered (--require-registered)")
        self._open(episode)
        return Tagged(episode, keyed=False)

    async def _owner_or_401(self, key: str) -> str:
        try:
            owner = await self._owner(key)
        except Exception as exc:  # the database cannot answer: the key cannot be checked
            raise unavailable(exc) from exc
        if owner is None:
            raise unauthorized("unknown tracetap episode key")
        return owner

    async def _owner(self, key: str) -> str | None:
        digest = hash_key(key)
        owner = self._keys.get(digest)
        if owner is None and not self._missed(digest):
            owner = await self._key_owner(digest)
            if owner is None:
                self._misses.put(digest, time.monotonic() + MISS_SECONDS)
            else:
                if self._is_finished is not None and await self._is_finished(owner):
                    self._finished.put(owner, True)  # finished before this process saw it
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
        until = float("inf") if self.following else time.monotonic() + MISS_SECONDS
        self._misses.put(episode, until)
        return False

    async def follow(self, registered_since: Callable[[float], Awaitable[list]],
                     clock=time.time,
                     wait: Callable[[], Awaitable[None]] | None = None) -> None:
        """Keep up with registrations made by any process (runs for the app's life): an id
        registered elsewhere is known here within FOLLOW_SECONDS (or as soon as ``wait``
        returns: the registration's notice, storage.notify), so ids found unregistered
        need not be asked about again. While the database cannot answer, misses fall back
        to MISS_SECONDS; once it answers, the registrations made meanwhile are read."""
        watermark = clock()
        while True:
            try:
                since = watermark - FOLLOW_OVERLAP
                while True:
                    rows = await registered_since(since)
                    for episode_id, registered_at in rows:
                        self._registered.put(episode_id, True)
                        watermark = max(watermark, registered_at)
                    if len(rows) < FOLLOW_BATCH or rows[-1][1] == since:
                        break
                    since = rows[-1][1]
                self.following = True
            except Exception as exc:  # the database cannot answer: fall back, say so once
                if self.following:
                    log.warning("cannot follow episode registrations (%s); unregistered ids "
                                "are asked about again every %gs meanwhile", exc, MISS_SECONDS)
                self.following = False
                self._forget_misses()
            if wait is None:
                await asyncio.sleep(FOLLOW_SECONDS)  # polling: no notices to wait on
            else:
                await wait()

    async def follow_finished(self, finished_since: Callable[[float], Awaitable[list]],
                              clock=time.time,
                              wait: Callable[[], Awaitable[None]] | None = None) -> None:
        """Keep up with finishes made by any process (runs for the app's life): a
        finished episode's key is refused here within FOLLOW_SECONDS (or as soon as
        ``wait`` returns: the finish's notice, storage.notify). A database that cannot
        answer is asked again at the next tick, from the same watermark."""
        watermark = clock()
        while True:
            try:
                for episode_id, finished_at in await finished_since(watermark - FOLLOW_OVERLAP):
                    self._finished.put(episode_id, True)
                    watermark = max(watermark, finished_at)
            except Exception as exc:  # the database cannot answer: next tick
                log.debug("cannot follow episode finishes: %s", exc)
            if wait is None:
                await asyncio.sleep(FOLLOW_SECONDS)  # polling: no notices to wait on
            else:
                await wait()

    def _forget_misses(self) -> None:
        """Misses believed while following are no longer safe to believe."""
        self._misses = Recent(REMEMBERED)

    def _missed(self, name: str) -> bool:
        until = self._misses.get(name)
        return until is not None and time.monotonic() < until
