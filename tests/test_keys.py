"""Episode keys and tagging: only a key's hash is stored, any replica honours it, and the
tagger asks the database only what it cannot know yet."""

from __future__ import annotations

import asyncio
import hashlib

import msgspec
import openai
import pytest
from helpers.loop import free_port
from helpers.servers import Proxy
from sqlalchemy import text

from tracetap.proxy.episodes import tagging
from tracetap.proxy.episodes.tagging import Tagger, hash_key, validate_episode_id
from tracetap.proxy.http.errors import ProxyError
from tracetap.storage.engine import create_engine

MESSAGES = [{"role": "user", "content": "hello"}]


def _mint(proxy, episode: str) -> str:
    status, created = proxy.admin("POST", "/tracetap/episodes", {"id": episode})
    assert status == 201, created
    return created["api_key"]


def _ask_with_key(base_url: str, key: str) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0)
    with client:
        client.chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=2)


def _episode_rows(db: str) -> list[tuple]:
    async def read():
        engine = create_engine(db)
        try:
            async with engine.connect() as conn:
                return [tuple(r) for r in await conn.execute(text("SELECT * FROM episodes"))]
        finally:
            await engine.dispose()

    return asyncio.run(read())


def test_the_database_holds_the_sha256_of_an_episode_key_never_the_key(proxy):
    key = _mint(proxy, "hashed")
    assert key.startswith("tt-") and len(key) > 40
    [row] = _episode_rows(proxy.settings.db)
    assert hashlib.sha256(key.encode()).hexdigest() in row
    assert not any(key in str(value) or key[3:] in str(value) for value in row)


def test_a_key_works_on_another_replica_and_after_a_restart(proxy, loop_thread, tmp_path):
    key = _mint(proxy, "roaming")

    def replica(name: str) -> Proxy:
        settings = msgspec.structs.replace(proxy.settings, port=free_port(),
                                           data_dir=str(tmp_path / name))
        return Proxy(loop_thread, settings).start()

    other = replica("other")
    try:
        _ask_with_key(other.url, key)  # minted elsewhere: found in the database
        # The key is the agent's credential: it may not report its own episode's result.
        assert other.admin("POST", "/tracetap/episodes/roaming/finish", {"reward": 1},
                           token=key)[0] == 403
        assert [c["episode_id"] for c in other.calls("roaming")] == ["roaming"]
    finally:
        other.stop()
    proxy.stop()
    restarted = replica("restarted")
    try:
        _ask_with_key(restarted.url, key)
        assert len(restarted.calls("roaming")) == 2
        assert restarted.calls(None) == []
    finally:
        restarted.stop()


# ---- the tagger on its own: what it asks the database, and when -----------------------------

class Lookups:
    """Stands in for the database's answers, and counts the questions."""

    def __init__(self, keys: dict[str, str] | None = None, registered: set[str] = frozenset()):
        self.keys = {hash_key(k): e for k, e in (keys or {}).items()}
        self.registered = set(registered)
        self.asked: list[str] = []

    async def key_owner(self, digest: str) -> str | None:
        self.asked.append(digest)
        return self.keys.get(digest)

    async def is_registered(self, episode: str) -> bool:
        self.asked.append(episode)
        return episode in self.registered

    def tagger(self, *, require_episode=False, require_registered=False) -> Tagger:
        return Tagger(key_owner=self.key_owner, is_registered=self.is_registered,
                      require_episode=require_episode, require_registered=require_registered)


def _tag(tagger: Tagger, path: str | None = None, key: str | None = None,
         header: str | None = None):
    headers = {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if header is not None:
        headers["X-Tracetap-Episode"] = header
    return asyncio.run(tagger.episode_for(headers, path))


def _refused(tagger: Tagger, **where) -> tuple[int, str, str]:
    with pytest.raises(ProxyError) as info:
        _tag(tagger, **where)
    return info.value.status, info.value.code, info.value.message


def test_a_key_owner_is_asked_once_then_remembered():
    lookups = Lookups({"tt-a": "ep-a"})
    tagger = lookups.tagger()
    assert _tag(tagger, key="tt-a") == _tag(tagger, key="tt-a") == "ep-a"
    assert lookups.asked == [hash_key("tt-a")]  # the hash, and only once
    tagger.remember("ep-b", hash_key("tt-b"))  # minted here: never asked at all
    assert _tag(tagger, key="tt-b") == "ep-b" and len(lookups.asked) == 1


def test_an_unknown_key_is_asked_again_once_the_miss_expires(monkeypatch):
    monkeypatch.setattr(tagging, "MISS_SECONDS", 0.0)
    lookups = Lookups()
    tagger = lookups.tagger()
    assert _refused(tagger, key="tt-later") == (401, "invalid_api_key",
                                               "unknown tracetap episode key")
    lookups.keys[hash_key("tt-later")] = "ep-later"  # another replica mints it meanwhile
    assert _tag(tagger, key="tt-later") == "ep-later"


def test_precedence_path_then_key_then_header_and_a_key_tags_only_its_own():
    tagger = Lookups({"tt-a": "ep-a"}).tagger()
    assert _tag(tagger, path="p", header="h") == "p"
    assert _tag(tagger, header="h") == "h"
    assert _tag(tagger) is None  # untagged, not refused
    assert _tag(tagger, path="ep-a", key="tt-a", header="ep-a") == "ep-a"
    other = (403, "forbidden", "this API key belongs to another episode")
    assert _refused(tagger, path="ep-b", key="tt-a") == other
    assert _refused(tagger, key="tt-a", header="ep-b") == other
    assert _tag(tagger, path="p", key="sk-not-ours") == "p"  # other keys are not ours


def test_require_episode_refuses_an_untagged_call_with_how_to_tag_it():
    tagger = Lookups().tagger(require_episode=True)
    with pytest.raises(ProxyError) as info:
        _tag(tagger)
    assert (info.value.status, info.value.code) == (400, "episode_required")
    assert info.value.message == (
        "this proxy requires an episode: use /episodes/<id>/v1 as the base URL, an episode "
        "API key, or the X-Tracetap-Episode header")
    assert _tag(tagger, header="h") == "h"


def test_require_registered_asks_until_an_episode_is_registered_then_wants_its_key(
        monkeypatch):
    monkeypatch.setattr(tagging, "MISS_SECONDS", 0.0)
    lookups = Lookups({"tt-k": "ep-k", "tt-new": "ep-new"})
    tagger = lookups.tagger(require_registered=True)
    assert _refused(tagger, path="ep-new") == (
        404, "not_found", "episode 'ep-new' is not registered (--require-registered)")
    lookups.registered.add("ep-new")
    needs_key = (403, "episode_credential_required", "episode 'ep-new' is registered: its "
                 "calls need its key (the base_url or api_key its registration returned)")
    assert _refused(tagger, path="ep-new") == _refused(tagger, header="ep-new") == needs_key
    assert lookups.asked.count("ep-new") == 2  # the miss, then found: remembered since
    assert _tag(tagger, path="ep-new", key="tt-new") == "ep-new"
    assert _tag(tagger, path="ep-new~new") == "ep-new"  # the key inside the base URL
    assert _tag(tagger, key="tt-k") == "ep-k"  # a key's episode is registered by minting
    assert "ep-k" not in lookups.asked
    tagger.remember("ep-here", None)
    assert _refused(tagger, path="ep-here")[:2] == (403, "episode_credential_required")
    assert "ep-here" not in lookups.asked


def test_a_registered_episode_takes_calls_only_with_its_key_even_when_not_required():
    lookups = Lookups({"tt-a": "ep-a", "tt-b": "ep-b"}, {"ep-a", "ep-b"})
    tagger = lookups.tagger()
    assert _tag(tagger, path="open") == "open"  # never registered: path tagging still works
    for where in ({"path": "ep-a"}, {"header": "ep-a"}, {"path": "ep-a", "key": "sk-x"}):
        assert _refused(tagger, **where)[:2] == (403, "episode_credential_required")
    assert _tag(tagger, path="ep-a~a") == _tag(tagger, key="tt-a", header="ep-a") == "ep-a"
    # Someone else's key, in the path or as the API key, opens nothing but its own episode.
    assert _refused(tagger, path="ep-a~b")[:2] == (403, "forbidden")
    assert _refused(tagger, path="ep-a~a", key="tt-b")[:2] == (403, "forbidden")
    assert _refused(tagger, path="ep-a~guess")[:2] == (401, "invalid_api_key")
    assert _refused(tagger, path="~a")[:2] == (400, "invalid_episode_id")
    assert _refused(tagger, path="bad/id~a")[:2] == (400, "invalid_episode_id")


@pytest.mark.parametrize("value", ["a", "A-z_0.9:x", "x" * 128])
def test_valid_episode_ids(value):
    assert validate_episode_id(value) == value


@pytest.mark.parametrize("value", ["", "x" * 129, "has space", "slash/", "é", 7, None])
def test_invalid_episode_ids_are_a_clear_400(value):
    with pytest.raises(ProxyError) as info:
        validate_episode_id(value)
    assert (info.value.status, info.value.code) == (400, "invalid_episode_id")
    assert info.value.message.startswith(f"invalid episode id {repr(value)[:80]}: use 1-128 ")
    tagger = Lookups().tagger()
    if isinstance(value, str) and value:
        assert _refused(tagger, header=value)[:2] == (400, "invalid_episode_id")


def test_key_owners_and_registered_ids_are_bounded(monkeypatch):
    monkeypatch.setattr(tagging, "REMEMBERED", 2)
    lookups = Lookups({f"tt-{i}": f"e{i}" for i in range(3)}, {"r0", "r1", "r2"})
    tagger = lookups.tagger(require_registered=True)
    assert [_tag(tagger, key=f"tt-{i}") for i in (0, 1, 0)] == ["e0", "e1", "e0"]
    assert len(lookups.asked) == 2  # the second use of tt-0 was answered from memory
    assert _tag(tagger, key="tt-2") == "e2"  # tt-1, the least recently used, is forgotten
    assert _tag(tagger, key="tt-1") == "e1"
    assert len(lookups.asked) == 4
    for e in ("r0", "r1", "r2", "r0"):  # registered: refused without their keys
        assert _refused(tagger, path=e)[0] == 403
    assert lookups.asked[4:] == ["r0", "r1", "r2", "r0"]  # r0 was forgotten for r2


def test_a_miss_is_believed_for_a_second_then_asked_again(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(tagging.time, "monotonic", lambda: now[0])
    lookups = Lookups()
    tagger = lookups.tagger(require_registered=True)
    for _ in range(3):
        assert _refused(tagger, key="tt-wrong")[0] == 401
        assert _refused(tagger, path="later")[0] == 404
    assert len(lookups.asked) == 2  # one query each, not one per request
    lookups.registered.add("later")  # registered through another worker meanwhile
    now[0] += tagging.MISS_SECONDS
    assert _refused(tagger, path="later")[:2] == (403, "episode_credential_required")
    assert _refused(tagger, key="tt-wrong")[0] == 401
    assert len(lookups.asked) == 4


def test_a_database_that_cannot_answer_keeps_open_ids_open_and_keys_unchecked():
    async def down(_):
        raise OSError("database unreachable")

    def tagger(**options):
        return Tagger(key_owner=down, is_registered=down, require_episode=False, **options)

    assert _tag(tagger(require_registered=False), path="open") == "open"  # capture goes on
    status, code, _ = _refused(tagger(require_registered=True), path="open")
    assert (status, code) == (503, "database_unavailable")
    status, code, _ = _refused(tagger(require_registered=False), key="tt-any")
    assert (status, code) == (503, "database_unavailable")


def test_a_follower_of_registrations_lets_misses_stand_until_one_is_registered(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(tagging.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(tagging, "FOLLOW_SECONDS", 0.0)
    lookups = Lookups()
    tagger = lookups.tagger()
    registrations: list[tuple[str, float]] = []
    reads: list[float] = []

    async def registered_since(since: float):
        reads.append(since)
        return [r for r in registrations if r[1] >= since]

    async def scenario():
        follower = asyncio.create_task(tagger.follow(registered_since, clock=lambda: 1000.0))
        while not tagger.following:
            await asyncio.sleep(0)
        assert await tagger.episode_for({}, "late") == "late"
        now[0] += 3600  # believed: not asked again, however long
        assert await tagger.episode_for({}, "late") == "late"
        assert lookups.asked == ["late"]
        registrations.append(("late", 1001.0))  # registered through another process
        seen_reads = len(reads)
        while len(reads) < seen_reads + 2:
            await asyncio.sleep(0)
        with pytest.raises(ProxyError) as refused:
            await tagger.episode_for({}, "late")
        assert refused.value.code == "episode_credential_required"
        assert lookups.asked == ["late"]
        follower.cancel()

    asyncio.run(scenario())
    assert reads[0] == 1000.0 - tagging.FOLLOW_OVERLAP
    assert reads[-1] == 1001.0 - tagging.FOLLOW_OVERLAP  # the newest seen, read again
