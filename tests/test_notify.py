"""Change notices (storage/notify.py) on a real Postgres: a notice wakes its topic's
follower at once; where notices never come back (a pooler in transaction mode), or on
SQLite, followers keep their fast interval (on SQLite, while something commits)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from tracetap.migrations import upgrade
from tracetap.proxy.overlays.patches import Patches
from tracetap.storage import notify
from tracetap.storage import patches as stored_patches
from tracetap.storage.controls import beat
from tracetap.storage.engine import create_engine
from tracetap.storage.notify import CONTROLS, EPISODES, PATCHES, Notices, send

SETTLE = notify.SQLITE_TICK_SECONDS + 0.05


async def _listening(notices: Notices, seconds: float = 10.0) -> asyncio.Task:
    task = asyncio.create_task(notices.run())
    deadline = time.monotonic() + seconds
    while not notices.live:
        assert time.monotonic() < deadline, "not listening"
        await asyncio.sleep(0.02)  # polling the listener's state
    return task


async def _stop(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_a_notice_wakes_the_follower_of_its_topic_only(migrated_postgres):
    async def run():
        engine = create_engine(migrated_postgres)
        notices = Notices(engine)
        task = await _listening(notices)
        try:
            await notices.wait(CONTROLS, 0.01, 0.01)  # the wake of going live, consumed
            await notices.wait(EPISODES, 0.01, 0.01)
            async with engine.begin() as conn:
                await send(conn, CONTROLS)
            started = time.monotonic()
            await notices.wait(CONTROLS, 30, 30)
            woke = time.monotonic() - started
            started = time.monotonic()
            await notices.wait(EPISODES, 30, 0.3)  # no notice of its own: its slow timeout
            slept = time.monotonic() - started
        finally:
            await _stop(task)
            await engine.dispose()
        return woke, slept

    woke, slept = asyncio.run(run())
    assert woke < 1.0
    assert slept >= 0.29


def test_an_installed_patch_wakes_the_processes_that_know_of_none(migrated_postgres):
    """A process with no patch yet follows installs by their notice (its slow look is for
    a lost notice only): the install elsewhere is seen at once."""
    async def run():
        engine = create_engine(migrated_postgres)
        notices = Notices(engine)
        patches = Patches(engine, None, frozenset())  # no worker is started here
        task = await _listening(notices)
        following = asyncio.create_task(patches.follow(
            lambda: notices.wait(PATCHES, 30, 30)))
        try:
            await asyncio.sleep(0.2)  # the wake of going live consumed: waiting on its notice
            assert not patches.any and not following.done()
            started = time.monotonic()
            await stored_patches.add(engine, name="p", sha256="0" * 64, source="X = 1",
                                     hooks=["before_model"], after_model_sees="last")
            await asyncio.wait_for(following, 10)  # it returns once a patch is known
            woke = time.monotonic() - started
        finally:
            following.cancel()
            await _stop(task)
            await engine.dispose()
        return woke, patches.any

    woke, known = asyncio.run(run())
    assert known and woke < 1.0


def test_a_listening_process_follows_the_controls_on_the_listening_connection(
        migrated_postgres, monkeypatch):
    """While notices arrive, the controls' read and this process's heartbeat run on the
    listening connection (held anyway): the pool is not asked. Once nothing listens,
    they go through the pool again."""
    from tracetap.proxy.policy.controls import Controls
    from tracetap.proxy.policy.gate import Gate
    from tracetap.storage import controls as table

    async def run():
        engine = create_engine(migrated_postgres)
        notices = Notices(engine)
        task = await _listening(notices)
        controls = Controls(engine, Gate(5.0), "listener", notices=notices)
        await table.store(engine, "policy_version", "v7")
        pooled = []
        read, beat = table.read, table.beat
        monkeypatch.setattr(table, "read", lambda *a: pooled.append("read") or read(*a))
        monkeypatch.setattr(table, "beat", lambda *a: pooled.append("beat") or beat(*a))
        try:
            await controls.refresh()
            on_listener = (controls.policy_version, list(pooled))
            beats = await table.peers(engine, 0.0, "someone else")
            await _stop(task)  # nothing listens now
            await table.store(engine, "policy_version", "v8")
            controls._beat_at = 0.0
            await controls.refresh()
        finally:
            await engine.dispose()
        return on_listener, beats, controls.policy_version, pooled

    on_listener, beats, version, pooled = asyncio.run(run())
    assert on_listener == ("v7", [])
    assert beats == ['{"paused":null,"inflight":0}']
    assert version == "v8" and pooled == ["read", "beat"]


def test_notices_that_never_come_back_leave_the_followers_polling(migrated_postgres,
                                                                  monkeypatch, caplog):
    monkeypatch.setattr(notify, "PROBE_SECONDS", 0.3)

    async def run():
        engine = create_engine(migrated_postgres)
        notices = Notices(engine)
        notices._notice = lambda *args: None  # what LISTEN behind PgBouncer gets: nothing
        task = asyncio.create_task(notices.run())
        try:
            await asyncio.sleep(1.5)
            started = time.monotonic()
            await notices.wait(CONTROLS, 0.05, 30)
            return notices.live, time.monotonic() - started
        finally:
            await _stop(task)
            await engine.dispose()

    with caplog.at_level(logging.WARNING, logger="tracetap"):
        live, waited = asyncio.run(run())
    assert live is False and waited < 1.0  # the fast interval, not the slow one
    assert any("change notices do not arrive" in r.getMessage() for r in caplog.records)


def test_sqlite_has_no_notices_and_its_followers_poll(tmp_path):
    async def run():
        engine = create_engine(f"sqlite:///{tmp_path / 't.db'}")
        notices = Notices(engine)
        watching = asyncio.create_task(notices.run())  # no listening: a watcher of files
        started = time.monotonic()
        await notices.wait(CONTROLS, 0.05, 30)  # its first look wakes every follower
        await _stop(watching)
        await engine.dispose()
        return notices.live, time.monotonic() - started

    live, waited = asyncio.run(run())
    assert live is False and waited < 1.0


@pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "timer"])
def test_an_idle_sqlite_process_wakes_for_its_topics_notice_only(tmp_path, monkeypatch,
                                                                 inotify):
    """One watcher follows the database's files for every follower (Notices.run). A
    commit that sends a topic's notice (its serial, on SQLite) wakes that topic's
    follower within a tick; one that sends none (another process's heartbeat) wakes no
    follower; with nothing committed they sleep until their slow interval. With inotify
    (Linux) the watcher itself does not wake while nothing is written; without it (the
    fallback) it looks each tick."""
    url = f"sqlite:///{tmp_path / 't.db'}"
    upgrade(url)
    if not inotify:
        monkeypatch.setattr(notify.file_watch, "watch", lambda directory: None)
    looks = []

    async def run():
        engine, other = create_engine(url), create_engine(url)
        notices = Notices(engine)
        stamp = notices._stamp
        monkeypatch.setattr(notices, "_stamp", lambda: looks.append(1) or stamp())
        watching = asyncio.create_task(notices.run())
        await asyncio.sleep(notify.SQLITE_TICK_SECONDS + SETTLE)  # its first looks
        for topic in (CONTROLS, EPISODES):  # the first look woke every follower
            await notices.wait(topic, 0.02, 30)
        looks.clear()
        started = time.monotonic()
        await notices.wait(CONTROLS, 0.02, 0.6)  # nothing committed: the slow interval
        idle, idle_looks = time.monotonic() - started, len(looks)

        async def commit_soon(topic: str | None):
            await asyncio.sleep(0.2)
            began = time.monotonic()
            if topic is None:
                await beat(other, "elsewhere", "{}")
            else:
                async with other.begin() as conn:
                    await send(conn, topic)
            return began

        committing = asyncio.create_task(commit_soon(None))
        started = time.monotonic()
        await notices.wait(EPISODES, 0.02, 0.8)  # a heartbeat: the slow interval
        await committing
        beaten = time.monotonic() - started
        committing = asyncio.create_task(commit_soon(EPISODES))
        await notices.wait(EPISODES, 0.02, 30)  # its notice wakes it
        woke = time.monotonic() - await committing
        await _stop(watching)
        await engine.dispose()
        await other.dispose()
        return idle, idle_looks, beaten, woke

    idle, idle_looks, beaten, woke = asyncio.run(run())
    assert idle >= 0.55  # nothing woke it before its slow interval
    if inotify:
        assert idle_looks == 0  # the watcher slept too
    else:
        assert idle_looks >= 2  # a look each tick
    assert beaten >= 0.75
    assert 0 <= woke < 1.0


def test_sqlite_followers_read_at_the_fast_tick_only_after_a_commit(tmp_path):
    """An idle SQLite process does not read the tables every fast tick: only once the
    database changed (a commit by another process: here another engine on the file), or
    when the slow interval is up."""
    url = f"sqlite:///{tmp_path / 't.db'}"

    async def run():
        from sqlalchemy import text

        engine, other = create_engine(url), create_engine(url)
        async with other.begin() as conn:
            await conn.execute(text("CREATE TABLE t (x INTEGER)"))
        notices = Notices(engine)
        await notices.wait(CONTROLS, 0.02, 30)  # the first tick: read
        started = time.monotonic()
        await notices.wait(CONTROLS, 0.02, 0.5)  # nothing committed: the slow interval
        idle = time.monotonic() - started

        async def commit_soon():
            await asyncio.sleep(0.2)
            async with other.begin() as conn:
                await conn.execute(text("INSERT INTO t VALUES (1)"))
            return time.monotonic()

        committing = asyncio.create_task(commit_soon())
        await notices.wait(CONTROLS, 0.02, 30)
        woke = time.monotonic() - await committing
        await engine.dispose()
        await other.dispose()
        return idle, woke

    idle, woke = asyncio.run(run())
    assert idle >= 0.45  # no fast tick let it through
    assert 0 <= woke < 1.0  # the commit's tick did
