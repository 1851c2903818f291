"""Change notices between proxy processes on one Postgres (LISTEN/NOTIFY).

Every process follows what others change in the shared database: the controls (pause,
policy version) and new registrations. Reading those tables every 200 ms, so that a pause
reaches every replica that fast, kept an idle replica at ~2% of a core. Instead the
transaction that changes a control or registers an episode sends a notice (``send``:
``pg_notify``, delivered at its commit), each process keeps one pooled connection
listening (``Notices.run``), and a notice wakes the follower of its topic at once. The
followers still read the tables now and then (``Notices.wait``'s slow interval), so a
notice lost with the listening connection costs seconds, not correctness; while nothing
listens (the connection is down, or SQLite, which has no notices) they read at their
fast interval, as before. On SQLite a notice is a serial per topic (a ``controls``
row the sending transaction raises), and one watcher (``Notices.run``) reads the serials
when the database file, its WAL or the WAL index changed (any commit, by any process,
writes there) and wakes the followers of the topics that moved: on Linux when the kernel
says a file of its directory was written (inotify, storage.file_watch), so an idle
process sleeps; elsewhere it looks every SQLITE_TICK_SECONDS. The processes'
heartbeats move no serial, so they wake no follower. Listening counts only
once a notice of its own came back: behind a connection pooler in transaction mode
(PgBouncer's default) LISTEN is accepted but no notice ever arrives, and the followers
keep their fast interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tracetap.storage import file_watch
from tracetap.storage.engine import one_statement

log = logging.getLogger("tracetap")

CHANNEL = "tracetap_changes"
CONTROLS = "controls"
EPISODES = "episodes"
FINISHED = "finished"  # an episode finished: its key takes no more calls anywhere
PATCHES = "patches"  # an overlay patch was installed
TOPICS = (CONTROLS, EPISODES, FINISHED, PATCHES)
RETRY_SECONDS = 2.0  # between attempts to listen again after the connection is lost
CHECK_SECONDS = 60.0  # how often a quiet listening connection is asked whether it is alive
PROBE_SECONDS = 5.0  # how long a notice of its own may take to come back
SQLITE_TICK_SECONDS = 0.2  # SQLite: the files looked at every tick without inotify, at
# most once a tick with it (``_next_change``)
_SHM_HEADER = 48  # bytes of SQLite's WAL index header (wal.c: WalIndexHdr)
_NOTIFY = text("SELECT pg_notify(:channel, :topic)")
# SQLite: one row per topic; a commit that is only a heartbeat (any process's) leaves them
# as they were, so it wakes no follower.
_SERIAL = "notice:"
_RAISE = text("INSERT INTO controls (name, value, serial, updated_at) VALUES (:name, NULL, 1, "
              ":now) ON CONFLICT (name) DO UPDATE SET serial = serial + 1, updated_at = :now")
_SERIALS = text("SELECT name, serial FROM controls WHERE name IN ("
                + ", ".join(f"'{_SERIAL}{topic}'" for topic in TOPICS) + ")")
_UNSEEN = object()  # a follower's first wait: it reads the tables at its first tick


async def send(conn: AsyncConnection, topic: str) -> None:
    """Notify every process of ``topic``, at the commit of ``conn``'s transaction: on
    Postgres a notice; on SQLite the topic's serial (a ``controls`` row) goes up, which
    the watcher of each process reads when the database's files change."""
    if conn.dialect.name == "postgresql":
        await conn.execute(_NOTIFY, {"channel": CHANNEL, "topic": topic})
    else:
        await conn.execute(_RAISE, {"name": _SERIAL + topic, "now": time.time()})


class Notices:
    """One listening connection per process and an event per topic."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.live = False  # a connection is listening: notices arrive
        self._events = {topic: asyncio.Event() for topic in TOPICS}
        self._failing = False
        self._probe = f"probe:{id(self)}"  # a notice only this process waits for
        self._probe_back = asyncio.Event()  # it came back, or PROBE_SECONDS passed
        self._probe_arrived = False
        self._files = _sqlite_files(engine)  # what a commit changes, on SQLite
        self._seen: dict[str, object] = {}  # the files as each topic's follower read
        self._watching = False  # SQLite: ``_watch`` runs, the followers only wait
        self._listener: Any = None  # Postgres: the listening driver connection, while live
        self._using = asyncio.Lock()  # one statement at a time on it

    async def wait(self, topic: str, fast: float, slow: float) -> None:
        """Until a notice of ``topic`` arrives, or ``slow`` seconds pass (``fast`` while
        nothing listens). Returns with the event cleared, so a notice that arrives while
        the caller reads the table wakes its next wait at once."""
        event = self._events[topic]
        if self._watching:  # SQLite: the watcher sets the event when its serial moved
            await _until_set(event, slow)
            event.clear()
            return
        if not event.is_set():
            loop = asyncio.get_running_loop()
            deadline = loop.time() + slow
            while True:
                await _until_set(event, slow if self.live else fast)
                if (self.live or self._files is None or loop.time() >= deadline
                        or self._stamp() != self._seen.get(topic, _UNSEEN)):
                    break
                event.clear()  # SQLite and nothing committed since the last read
        event.clear()
        if self._files is not None:
            self._seen[topic] = self._stamp()

    async def _watch(self) -> None:
        """SQLite: one watcher for every follower (each ticked at its own fast interval
        and looked at the files itself: nine wake-ups a second of an idle process). On
        Linux the kernel says when a file of the database's directory is written
        (storage.file_watch), so an idle process does not wake at all; elsewhere it looks
        every SQLITE_TICK_SECONDS. A change wakes the followers of the topics whose serial
        it raised (``send``): a heartbeat wakes none. The first look, and a look that
        cannot read the serials, wake every follower (the first: what was committed
        between a follower's first read and this task's start)."""
        loop = asyncio.get_running_loop()
        changes = file_watch.watch(os.path.dirname(os.path.abspath(self._files[0])))
        changed = asyncio.Event()
        if changes is not None:
            changes.start(loop, changed.set)
            changed.set()  # the first look, at once
        self._watching = True
        try:
            last: object = _UNSEEN
            seen: dict[str, int] | None = None  # the topics' serials at the last look
            settle = False
            while True:
                if changes is None:
                    await asyncio.sleep(SQLITE_TICK_SECONDS)
                else:
                    await _next_change(changed, settle)
                stamp = self._stamp()
                settle = stamp != last
                if settle:
                    last = stamp
                    serials = await self._serials()
                    for topic, event in self._events.items():
                        if serials is None or seen is None or \
                                serials.get(topic) != seen.get(topic):
                            event.set()
                    seen = serials
        finally:
            self._watching = False
            if changes is not None:
                changes.close()

    async def _serials(self) -> dict[str, int] | None:
        """SQLite: each topic's serial (``send``); None when they cannot be read (every
        follower then reads for itself)."""
        try:
            async with one_statement(self.engine) as conn:
                rows = (await conn.execute(_SERIALS)).all()
        except Exception as exc:  # locked past the busy timeout, or not migrated
            log.debug("cannot read the change serials: %s", exc)
            return None
        return {name.removeprefix(_SERIAL): serial for name, serial in rows}

    def _stamp(self) -> tuple | None:
        """The SQLite files' identity, size and modification time, and the WAL index's
        header."""
        try:
            files = tuple((st.st_ino, st.st_size, st.st_mtime_ns)
                          for st in map(os.stat, self._files))
        except OSError:
            return None  # a WAL not there (yet): compared as such
        try:  # the WAL index's header: it changes with every commit
            fd = os.open(self._files[0] + "-shm", os.O_RDONLY)
        except OSError:
            return files
        try:
            return files, os.pread(fd, _SHM_HEADER, 0)
        finally:
            os.close(fd)

    def _wake_all(self) -> None:
        """A change of ``live``: followers read the tables now (what changed while nobody
        listened) and wait at the interval that now applies."""
        for event in self._events.values():
            event.set()

    def _notice(self, _connection, _pid: int, _channel: str, payload: str) -> None:
        if payload == self._probe:
            self._probe_arrived = True
            self._probe_back.set()
        elif (event := self._events.get(payload)) is not None:
            event.set()

    async def run(self) -> None:
        """Listen until cancelled, again after a lost connection (Postgres); on SQLite,
        watch the database's files for every follower."""
        if self._files is not None:
            await self._watch()
        if self.engine.dialect.name != "postgresql":
            return
        while True:
            try:
                await self._listen()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the database is down: the followers poll meanwhile
                if not self._failing:
                    log.warning("cannot listen for change notices (%s); following the "
                                "shared tables by polling until it can", exc)
                self._failing = True
            finally:
                if self.live:
                    self.live = False
                    self._wake_all()
            await asyncio.sleep(RETRY_SECONDS)

    async def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        async with self.engine.connect() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            wake = asyncio.Event()  # the connection ended, or it is time to ask
            raw.add_termination_listener(lambda _c: wake.set())
            await raw.add_listener(CHANNEL, self._notice)
            try:
                if self._failing:
                    log.info("listening for change notices again")
                self._failing = False
                self.live = await self._notices_arrive()
                self._listener = raw if self.live else None
                self._wake_all()
                while True:
                    timer = loop.call_later(CHECK_SECONDS, wake.set)
                    try:
                        await wake.wait()
                    finally:
                        timer.cancel()
                    wake.clear()
                    if raw.is_closed():
                        await conn.invalidate()  # not handed back to the pool
                        return
                    async with self._using:
                        await raw.execute("SELECT 1")  # a dead peer shows only when asked
            finally:
                self._listener = None
                if not raw.is_closed():
                    with contextlib.suppress(Exception):
                        await raw.remove_listener(CHANNEL, self._notice)

    @contextlib.asynccontextmanager
    async def listening(self) -> AsyncIterator[Any]:
        """The listening connection's driver (asyncpg) for a follower's own statements
        while notices arrive, one user at a time; None otherwise (use the pool). It is
        held anyway: the controls' read and heartbeat on it cost no checkout and no ping
        (most of an idle replica's CPU after its lease)."""
        raw = self._listener
        if raw is None or raw.is_closed():
            yield None
            return
        async with self._using:
            yield raw

    async def _notices_arrive(self) -> bool:
        """Send a notice of its own and wait for it to come back."""
        self._probe_back.clear()
        self._probe_arrived = False
        async with self.engine.begin() as conn:
            await send(conn, self._probe)
        timer = asyncio.get_running_loop().call_later(PROBE_SECONDS, self._probe_back.set)
        try:
            await self._probe_back.wait()
        finally:
            timer.cancel()
        if not self._probe_arrived:
            log.warning("change notices do not arrive (LISTEN through a connection pooler "
                        "in transaction mode?); following the shared tables by polling")
        return self._probe_arrived


async def _until_set(event: asyncio.Event, seconds: float) -> None:
    """Until ``event`` is set, or ``seconds`` pass: a timer sets it then (not wait_for: no
    task per wait)."""
    if event.is_set():
        return
    timer = asyncio.get_running_loop().call_later(seconds, event.set)
    try:
        await event.wait()
    finally:
        timer.cancel()


async def _next_change(changed: asyncio.Event, settle: bool) -> None:
    """Until the kernel says a file changed, then at least SQLITE_TICK_SECONDS after the
    last look (a busy writer's commits are looked at once a tick, not each). After a look
    that saw a change, a tick later besides: a commit writes its WAL frames, then the WAL
    index in the -shm file, which readers take their snapshot from and which is mapped
    memory (no event), so a writer stopped between the two is looked at again."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    timer = loop.call_later(SQLITE_TICK_SECONDS, changed.set) if settle else None
    try:
        await changed.wait()
    finally:
        if timer is not None:
            timer.cancel()
    if settle and (rest := began + SQLITE_TICK_SECONDS - loop.time()) > 0:
        await asyncio.sleep(rest)  # the events meanwhile are this look's
    changed.clear()


def _sqlite_files(engine: AsyncEngine) -> tuple[str, str] | None:
    """A SQLite database file and its WAL (None for Postgres or an in-memory database)."""
    if engine.dialect.name != "sqlite":
        return None
    path = engine.url.database
    if not path or path == ":memory:" or path.startswith("file:"):
        return None
    return path, path + "-wal"
