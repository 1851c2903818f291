"""storage.intents on its own: an admitted call's intent and the replica's lease reach the
database off the request path; an answer waits for its intent only within a bound; a
journal adopted from another replica settles that replica's lease."""

from __future__ import annotations

import asyncio
import time

import asyncpg
import pytest
from sqlalchemy import select, text

from tracetap.storage import intents as intents_module
from tracetap.storage.engine import create_engine
from tracetap.storage.intents import CLOSED, OPEN, Intents, replica_id
from tracetap.storage.journal import adopt
from tracetap.storage.replicas import holds
from tracetap.storage.tables import CallIntent, Replica


def _run(url: str, work):
    async def go():
        engine = create_engine(url)
        try:
            return await work(engine)
        finally:
            await engine.dispose()
    return asyncio.run(go())


def test_an_admitted_call_is_stored_and_the_lease_covers_it(db_url, tmp_path):
    async def work(engine):
        intents = Intents(engine, replica_id(tmp_path), directory=tmp_path)
        intents.ready = True
        intents.start()
        admitted = time.time()
        intents.admit("call-1", "ep")
        intents.admit("call-0", None)  # untagged: no episode to hold back
        assert not intents.landed("call-1") and intents.landed("call-0")
        await intents.wait("call-1")  # the answer's end: lands well within the bound
        assert intents.landed("call-1") and intents.late == 0
        async with engine.connect() as conn:
            stored = (await conn.execute(select(CallIntent.call_id))).scalars().all()
            lease = (await conn.execute(select(Replica))).one()
            found = await holds(conn)
        await intents.close(clean=True)
        async with engine.connect() as conn:
            closed = (await conn.execute(select(Replica.state))).scalar()
        return stored, lease, found, admitted, closed

    stored, lease, found, admitted, closed = _run(db_url, work)
    assert stored == ["call-1"]
    assert lease.state == OPEN and lease.settled_at >= admitted
    assert "ep" in found.waiting  # no call row yet: its episode is held
    assert closed == CLOSED


def test_an_answer_waits_for_its_intent_only_within_the_bound(tmp_path):
    # A database that does not answer: the first answer waits the bound, later ones not.
    async def work(engine):
        intents = Intents(engine, "r", wait=0.2, heartbeat=0.05)
        intents.start()
        intents.admit("c1", "ep")
        started = time.monotonic()
        await intents.wait("c1")
        first = time.monotonic() - started
        await asyncio.sleep(0.3)  # the writer has failed by now
        intents.admit("c2", "ep")
        started = time.monotonic()
        await intents.wait("c2")
        second = time.monotonic() - started
        await intents.close(clean=False)
        return first, second, intents.late, intents.healthy

    first, second, late, healthy = _run("postgresql://nobody@127.0.0.1:9/none", work)
    assert 0.15 < first < 2.0 and second < 0.05
    assert late == 2 and not healthy


def test_an_adopted_journal_settles_its_replica(db_url, tmp_path):
    orphan, into = tmp_path / "journal-2", tmp_path / "journal"
    gone = replica_id(orphan)

    async def work(engine):
        old = Intents(engine, gone)
        old.ready = True
        old.admit("cut-call", "ep")  # a stream cut when its worker went away
        await old.flush()
        await old.close(clean=False)  # its connection goes with it; its lease stays open
        adopt(orphan, into)
        intents = Intents(engine, replica_id(into), directory=into)
        stones = await intents.previous()
        async with engine.connect() as conn:
            state = (await conn.execute(select(Replica.state).where(
                Replica.replica == gone))).scalar()
        return stones, state

    stones, state = _run(db_url, work)
    assert [(s.call_id, s.episode_id, s.status) for s in stones] == [
        ("cut-call", "ep", "record_lost")]
    assert state == CLOSED
    assert not (into / "adopted").exists() and not (orphan / "replica").exists()


def test_intents_queued_during_a_flush_are_the_next_batch_at_once(db_url, tmp_path):
    """The writer sleeps only while nothing is queued: a call admitted while the previous
    batch is being written (admit wakes the writer only when the queue was empty) is
    written right after it, not at the next heartbeat, so its answer does not wait the
    bound (a long heartbeat here: it would)."""
    async def work(engine):
        intents = Intents(engine, replica_id(tmp_path), directory=tmp_path, wait=2.0,
                          heartbeat=30.0)
        intents.ready = True
        renew, writes = intents._renew, []

        async def renew_admitting_another(*args, **kwargs):
            writes.append(args)
            if len(writes) == 1:  # during the first batch's write
                intents.admit("call-2", "ep")
            await renew(*args, **kwargs)

        intents._renew = renew_admitting_another
        intents.start()
        intents.admit("call-1", "ep")
        await intents.wait("call-1")
        started = time.monotonic()
        await intents.wait("call-2")
        waited = time.monotonic() - started
        late = intents.late
        await intents.close(clean=True)
        return waited, late

    waited, late = _run(db_url, work)
    assert late == 0 and waited < 1.0, (waited, late)


def test_an_intent_connection_the_database_cut_is_replaced(migrated_postgres):
    """Intents are written on one connection kept for them (storage/held_insert.py): when
    the database cuts it, that write fails (the writer's loop retries it) and the next
    takes a fresh connection; nothing admitted is lost."""
    async def work(engine):
        intents = Intents(engine, "held-replica")
        intents.ready = True
        intents.admit("first", "ep")
        await intents.flush()
        pid = intents._held._driver.get_server_pid()
        async with engine.connect() as conn:
            await conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        intents.admit("second", "ep")
        # which error depends on when the cut is seen: a reply, the socket, or the protocol
        with pytest.raises((asyncpg.PostgresError, asyncpg.InterfaceError,
                            asyncpg.InternalClientError, OSError)):
            await intents.flush()
        assert not intents.landed("second")
        await intents.flush()  # a fresh connection
        assert intents.landed("second")
        assert intents._held._driver.get_server_pid() != pid
        async with engine.connect() as conn:
            stored = (await conn.execute(select(CallIntent.call_id).where(
                CallIntent.replica == "held-replica"))).scalars().all()
        await intents.close(clean=False)
        return sorted(stored)

    assert _run(migrated_postgres, work) == ["first", "second"]


def test_an_intent_is_written_as_it_is_admitted_not_when_its_answer_asks(db_url, tmp_path):
    """The intent's statement starts at admission, beside the call's upstream request,
    so a short call's answer finds it stored: nothing waits for ``wait`` to hurry a
    gathered batch (whose round trip then sat between the reply and the answer). Two
    calls admitted in the same pass of the loop still go in one statement."""
    async def work(engine):
        intents = Intents(engine, replica_id(tmp_path), directory=tmp_path, heartbeat=30.0)
        intents.ready = True
        renew, batches = intents._renew, []

        async def recorded(*args, **kwargs):
            batches.append([row["call_id"] for row in kwargs.get("batch", ())])
            await renew(*args, **kwargs)

        intents._renew = recorded
        intents.start()
        await asyncio.sleep(0.1)  # the first lease renewal (no intents) is done
        batches.clear()
        intents.admit("call-1", "ep")
        intents.admit("call-2", "ep")
        for _ in range(5):  # a few passes of the loop, no time: no one calls wait
            await asyncio.sleep(0)
        started = list(batches)  # the statements begun by then
        await intents.wait("call-2")
        landed = intents.landed("call-1") and intents.landed("call-2")
        await intents.close(clean=True)
        return started, landed

    started, landed = _run(db_url, work)
    assert started == [["call-1", "call-2"]], "no statement began before an answer asked"
    assert landed


def test_a_lease_moves_only_once_ready_and_its_heartbeat_always(db_url, tmp_path):
    """A restarted replica's lease keeps the ``settled_at`` its previous life left until
    that life's intents are resolved (``ready``); its heartbeat moves from the start (on
    Postgres both go through the kept connection's prepared statement)."""
    async def work(engine):
        intents = Intents(engine, replica_id(tmp_path), directory=tmp_path, heartbeat=30.0)
        await intents.flush()  # the first lease
        read = select(Replica.settled_at, Replica.heartbeat_at, Replica.state)
        async with engine.connect() as conn:
            first = (await conn.execute(read)).one()
        await asyncio.sleep(0.05)
        await intents._renew()
        async with engine.connect() as conn:
            not_ready = (await conn.execute(read)).one()
        intents.ready = True
        await asyncio.sleep(0.05)
        await intents._renew()
        async with engine.connect() as conn:
            ready = (await conn.execute(read)).one()
        await intents.close(clean=True)
        return first, not_ready, ready

    first, not_ready, ready = _run(db_url, work)
    assert not_ready.settled_at == first.settled_at
    assert not_ready.heartbeat_at > first.heartbeat_at and not_ready.state == OPEN
    assert ready.settled_at > first.settled_at and ready.heartbeat_at > not_ready.heartbeat_at


def test_stored_intents_are_cleaned_up_and_an_idle_replica_stops_asking(db_url, tmp_path,
                                                                        monkeypatch):
    """Intents whose call row is stored are deleted at the next cleanup; once nothing has
    been admitted for two cleanups, an idle replica renews its lease without them."""
    monkeypatch.setattr(intents_module, "_CLEANUP_SECONDS", 0.0)

    async def work(engine):
        intents = Intents(engine, replica_id(tmp_path), directory=tmp_path, heartbeat=0.0)
        intents.ready = True
        cleanups = []
        cleanup = intents._cleanup

        async def counted():
            cleanups.append(1)
            await cleanup()

        intents._cleanup = counted
        intents.admit("stored-call", "ep")
        await intents.flush()  # the intent, and a cleanup (its row is not stored yet)
        await _store_call(engine, "stored-call")
        await intents.flush()  # the second cleanup: the row is stored, the intent goes
        async with engine.connect() as conn:
            left = (await conn.execute(select(CallIntent.call_id))).scalars().all()
        for _ in range(3):
            await intents.flush()  # idle: the lease alone
        await intents.close(clean=False)
        return len(cleanups), left

    cleanups, left = _run(db_url, work)
    assert left == []
    assert cleanups == 2


async def _store_call(engine, call_id: str) -> None:
    from tracetap.storage.records import CallRecord
    from tracetap.storage.refusal import write_batch

    await write_batch(engine, [CallRecord(call_id=call_id, episode_id="ep", instance="r",
                                          endpoint="chat_completions", status="ok",
                                          t_start=time.time())])


def test_a_woken_writer_begins_its_statement_within_two_passes_of_the_loop(db_url, tmp_path):
    """The idle writer, woken by an admission, begins the intent's statement in the second
    pass of the loop after the call yields (its first: the call's upstream request goes out
    first): the statement's round trip runs beside the upstream's. Each pass later is one
    more chance for a short call's reply to come back before its intent, and its answer to
    wait for it."""
    async def work(engine):
        intents = Intents(engine, replica_id(tmp_path), directory=tmp_path, heartbeat=30.0)
        intents.ready = True
        renew, batches = intents._renew, []

        async def recorded(*args, **kwargs):
            batches.append([row["call_id"] for row in kwargs.get("batch", ())])
            await renew(*args, **kwargs)

        intents._renew = recorded
        intents.start()
        await asyncio.sleep(0.1)  # the first lease renewal (no intents) is done
        batches.clear()
        intents.admit("call-1", "ep")
        await asyncio.sleep(0)  # the call yields (its upstream request is sent)
        await asyncio.sleep(0)
        begun = list(batches)
        await intents.wait("call-1")
        await intents.close(clean=True)
        return begun

    assert _run(db_url, work) == [["call-1"]], "the statement had not begun in two passes"
