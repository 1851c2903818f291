"""Pause and policy version, shared by every proxy process on one database.

An admin call stores the change (``storage.controls``), applies it in its own process at
once, and returns; every other process (``--workers``, replicas) reads the table when the
change's notice arrives (``storage.notify``: Postgres) and applies what changed, so a change
reaches them within a query's time. They read it every IDLE_POLL_SECONDS besides (a lost
notice), and every POLL_SECONDS while no notices come (SQLite, a lost listening connection)
or while paused (the heartbeat then reports each process's calls in flight). Both survive a
restart: a process starts with what the table says. Each process also writes a heartbeat
(whether it holds the pause, how many calls it has in flight), which is how a pause waits
for every process to drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable

import msgspec
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.proxy.policy.gate import Gate
from tracetap.storage import controls as table
from tracetap.storage.engine import one_statement
from tracetap.storage.notify import CONTROLS, Notices

log = logging.getLogger("tracetap")

POLICY = "policy_version"
PAUSED = "paused"
ABORT = "abort"  # the paused row's value for a pause that cuts calls in flight
POLL_SECONDS = 0.2
IDLE_POLL_SECONDS = 5.0  # while notices arrive and nothing is paused
# A running process's heartbeat only says it is alive (a pause waits for the live ones):
# each one is a database write, the largest part of an idle process's CPU at 1 s.
HEARTBEAT_SECONDS = 4.0
LIVE_SECONDS = 12.0  # a process whose heartbeat is older is taken for gone
FORGET_SECONDS = 60.0


class Heartbeat(msgspec.Struct):
    paused: int | None  # the serial of the pause this process holds, None when running
    inflight: int


class Controls:
    def __init__(
        self,
        engine: AsyncEngine,
        gate: Gate,
        instance: str,
        on_pause: Callable[[bool], None] = lambda paused: None,
        notices: Notices | None = None,
    ):
        self.engine = engine
        self.notices = notices or Notices(engine)
        self.gate = gate
        self.instance = instance
        self.on_pause = on_pause
        self.policy_version: str | None = None
        self._applied = {POLICY: 0, PAUSED: 0}
        # Grows with every change applied here (pause, resume, version): a call whose
        # tokens arrived across a change knows it (proxy.policy.versions, which reads it for
        # every streamed token: a plain attribute, not a property).
        self.serial = 0
        self._beat_at = 0.0
        self._failing = False

    def _apply(self, name: str, value: str | None, serial: int) -> None:
        """Apply a stored change unless a newer one is applied already (a poll that read
        the table before an admin call of this process stored its change comes later)."""
        if serial <= self._applied[name]:
            return
        self._applied[name] = serial
        self.serial = self._applied[POLICY] + self._applied[PAUSED]
        if name == POLICY:
            self.policy_version = value
        elif value in ("1", ABORT):
            self.gate.close()
            self.on_pause(True)
            if value == ABORT:
                self.gate.cut_all()  # cut in-flight calls; each is continued
                # (proxy.call.continuation)
        else:
            self.gate.open()
            self.on_pause(False)

    async def refresh(self) -> None:
        async with self.notices.listening() as driver:
            if driver is not None:  # Postgres, notices arriving: on their connection
                try:
                    await self._follow(functools.partial(table.read_on, driver),
                                       functools.partial(table.beat_on, driver))
                    return
                except Exception as exc:  # it broke: the listener reconnects; the pool now
                    log.debug("controls on the listening connection failed: %s", exc)
        async with contextlib.AsyncExitStack() as stack:
            # Postgres: the read and the heartbeat on one autocommit connection. SQLite
            # gives each its own transaction (a read one turned writer fails while another
            # process writes).
            target = self.engine if self.engine.dialect.name != "postgresql" else \
                await stack.enter_async_context(one_statement(self.engine))
            await self._follow(functools.partial(table.read, target),
                               functools.partial(table.beat, target))

    async def _follow(self, read, beat) -> None:
        """Apply what the table says; then this process's heartbeat, when due."""
        found = await read((POLICY, PAUSED))
        for name in (POLICY, PAUSED):  # the version first: calls a resume releases get it
            if name in found:
                self._apply(name, *found[name])
        now = time.monotonic()
        if self.gate.paused or now - self._beat_at >= HEARTBEAT_SECONDS:
            heartbeat = Heartbeat(
                self._applied[PAUSED] if self.gate.paused else None, self.gate.inflight
            )
            await beat(self.instance, msgspec.json.encode(heartbeat).decode())
            self._beat_at = now  # a beat that failed is due again at the next read

    async def set_policy(self, version: str) -> None:
        self._apply(POLICY, version, await table.store(self.engine, POLICY, version))

    async def pause(self, abort: bool = False) -> int:
        """Hold new calls in every process; returns the pause's serial. ``abort``: also
        cut the calls in flight, to be continued after the resume (proxy.call.continuation)."""
        value = ABORT if abort else "1"
        serial = await table.store(self.engine, PAUSED, value)
        self._apply(PAUSED, value, serial)
        return serial

    async def resume(self, version: str | None) -> None:
        if version is not None:
            await self.set_policy(version)
        self._apply(PAUSED, "0", await table.store(self.engine, PAUSED, "0"))

    async def drained(self, serial: int, timeout: float) -> bool:
        """Whether every live process held pause ``serial`` with no call in flight, within
        ``timeout`` seconds (False once a resume came first)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            await asyncio.wait_for(self.gate.drained(), timeout)
        except asyncio.TimeoutError:
            return False
        while self.gate.paused:
            beats = await table.peers(self.engine, time.time() - LIVE_SECONDS, self.instance)
            if all(_drained(beat, serial) for beat in beats):
                return self.gate.idle
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(POLL_SECONDS)  # the other processes report every poll
        return False

    async def run(self) -> None:
        """Follow the table until cancelled; a database outage is logged, not fatal."""
        while True:
            try:
                await self.refresh()
                if self._failing:
                    log.info("shared controls readable again")
                self._failing = False
            except Exception as exc:  # the database is down: keep what was applied
                if not self._failing:
                    log.warning("cannot read the shared controls (pause, policy version): %s", exc)
                self._failing = True
            await self.notices.wait(CONTROLS, POLL_SECONDS,
                                    POLL_SECONDS if self.gate.paused else IDLE_POLL_SECONDS)

    async def close(self) -> None:
        with contextlib.suppress(Exception):  # stale heartbeats are ignored anyway
            await table.forget(self.engine, self.instance, time.time() - FORGET_SECONDS)


def _drained(value: str | None, serial: int) -> bool:
    try:
        beat = msgspec.json.decode(value or b"", type=Heartbeat)
    except msgspec.DecodeError:
        return False
    return beat.paused is not None and beat.paused >= serial and beat.inflight == 0
