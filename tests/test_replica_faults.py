"""A replica killed with an answered call still in its journal (three real replicas on
the real Postgres): the episode is never exported as if complete; once the call is stored
(the replica restarts, or an operator replays its journal) a later incremental export
picks it up, and every answered call is in the union of the exports exactly once. A
replica that never comes back and left no journal is given up on (`tracetap db lost`):
its episodes export marked infra. A stream its death cut leaves a tombstone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import asyncpg
import openai
import pyarrow.parquet as pq
import pytest
from helpers.http import finish, get
from helpers.loop import free_port, wait_until
from helpers.servers import Forwarder, stored_calls

from tracetap.exporters import export
from tracetap.exporters.prune import prune_exported
from tracetap.migrations import upgrade
from tracetap.storage.replicas import STALE_SECONDS


def _ask(base_url: str, content: str) -> None:
    """One agent call, answered in full (200)."""
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=30)
    with client:
        reply = client.chat.completions.create(
            model="mock-model", messages=[{"role": "user", "content": content}], max_tokens=8)
    assert reply.choices[0].finish_reason is not None


def _cut_stream(base_url: str, started: threading.Event) -> None:
    """A long stream; the replica serving it dies after its first chunk."""
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=30)
    with client, contextlib.suppress(openai.APIError):
        for _ in client.chat.completions.create(
                model="mock-model", messages=[{"role": "user", "content": "cut-stream"}],
                stream=True, extra_body={"mock_completion_tokens": 400,
                                         "mock_chunk_delay_s": 0.05}):
            started.set()


def _backlog(proxy) -> int:
    _, ready = get(proxy.url + "/readyz", timeout=5)
    return ready["journal"]["bytes"]


def _sql(db: str, query: str, *args):
    async def run():
        conn = await asyncpg.connect(db)
        try:
            return await conn.fetch(query, *args)
        finally:
            await conn.close()
    return asyncio.run(run())


@contextlib.contextmanager
def _calls_locked(loop_thread, db: str):
    """No writer can store a call meanwhile (reads, and intents, go on): what replicas
    answer stays in their journals."""
    conn = loop_thread.run(asyncpg.connect(db))
    loop_thread.run(conn.execute("BEGIN; LOCK TABLE calls IN EXCLUSIVE MODE"))
    try:
        yield
    finally:
        loop_thread.run(conn.execute("ROLLBACK"))
        loop_thread.run(conn.close())


def _exported(out: Path, run: int, dataset: str) -> list[dict]:
    manifest = json.loads((out / "_manifest.json").read_text())
    files = [f for f in manifest["runs"][run]["files"] if f.startswith(dataset + "/")]
    return [row for f in files for row in pq.read_table(out / f).to_pylist()]


def _integrity(out: Path, run: int) -> dict[str, str]:
    """Each episode a run exported, with its integrity (the same on all of its rows)."""
    seen = {(r["episode_id"], r["integrity"]) for dataset in ("calls", "trajectories")
            for r in _exported(out, run, dataset)}
    assert len(seen) == len(dict(seen)), seen
    return dict(seen)


def _content(row: dict) -> str | None:
    request = row["request"]
    return None if request is None else json.loads(request)["messages"][-1]["content"]


def _fault(engine, db: str, run_proxy, loop_thread, tmp_path: Path):
    """Three replicas; "early" stored and finished before the fault; then replica a
    answers "split"'s last call while no call can be stored, serves "cut" a stream, and
    is killed. Returns a's data dir and the contents answered with 200."""
    upgrade(db)
    a, b, c = (run_proxy(engine.url, db, data_dir=tmp_path / n) for n in "abc")
    answered = []
    for episode in ("early", "split"):
        for i, replica in enumerate((a, b, c)):
            answered.append(f"{episode}-{i}")
            _ask(replica.episode_url(episode), answered[-1])
    _ask(c.episode_url("cut"), "cut-0")
    answered.append("cut-0")
    finish(b, "early")
    # Every lease has passed its finish (renewed each second): "early" is settled.
    wait_until(lambda: _sql(db, "SELECT 1 WHERE (SELECT min(settled_at) FROM replicas) >= "
                                "(SELECT finished_at FROM episodes WHERE id = 'early')"),
               "the leases to pass early's finish", 10)
    with _calls_locked(loop_thread, db):
        _ask(a.episode_url("split"), "split-journal-only")  # 200: journaled, not stored
        answered.append("split-journal-only")
        started = threading.Event()
        stream = threading.Thread(target=_cut_stream, args=(a.episode_url("cut"), started))
        stream.start()
        assert started.wait(30)
        replica = (tmp_path / "a" / "journal" / "replica").read_text().strip()
        wait_until(lambda: _sql(db, "SELECT 1 FROM call_intents WHERE episode_id = 'cut' "
                                    "AND replica = $1", replica),
                   "the cut stream's intent to be stored", 10)
        a.signal(signal.SIGKILL)
        assert a.wait() == -signal.SIGKILL
        stream.join(30)
    wait_until(lambda: _backlog(b) == 0 and _backlog(c) == 0, "b and c to store theirs", 30)
    finish(b, "split")
    finish(c, "cut", reward=0.0)
    return tmp_path / "a", answered


def _first_export_holds_the_fault(db: str, out: Path, answered: list[str]) -> None:
    first = export(db, out, incremental=True)
    # "split" waits for a's journal, "cut" for a's lease: neither is exported yet, and
    # certainly not as complete and clean.
    assert {r["episode_id"] for r in _exported(out, 0, "trajectories")} == {"early"}
    assert first.held == 2
    assert "split-journal-only" not in {_content(r) for r in _exported(out, 0, "calls")}


def _union_once(out: Path, runs: int, answered: list[str]) -> Counter:
    rows = [r for run in range(runs) for r in _exported(out, run, "calls")]
    contents = Counter(_content(r) for r in rows if r["status"] == "ok")
    assert contents == Counter(answered), "every answered call exactly once"
    return Counter(r["status"] for r in rows)


def test_a_killed_replica_s_answered_call_is_exported_once_after_it_restarts(
        engine, fresh_postgres, run_proxy, loop_thread, tmp_path):
    db, out = fresh_postgres, tmp_path / "out"
    a_dir, answered = _fault(engine, db, run_proxy, loop_thread, tmp_path)
    _first_export_holds_the_fault(db, out, answered)
    assert prune_exported(db, out).counts.episodes == 1  # early; split and cut wait

    a = run_proxy(engine.url, db, data_dir=a_dir)  # restarts on its journal: replays it
    wait_until(lambda: _backlog(a) == 0, "a's journal to be replayed", 30)
    # The stream its death cut is a tombstone (the record never reached the journal).
    lost = wait_until(lambda: [x for x in stored_calls(db, "cut")
                               if x["status"] == "record_lost"], "the cut stream's tombstone")
    assert len(lost) == 1
    second = export(db, out, incremental=True)
    assert second.held == 0
    assert _integrity(out, 1) == {"split": "clean", "cut": "infra"}
    causes = {r["integrity_cause"] for r in _exported(out, 1, "calls")
              if r["episode_id"] == "cut"}
    assert causes == {None, "record_lost"}
    statuses = _union_once(out, 2, answered)
    assert statuses["record_lost"] == 1
    assert export(db, out, incremental=True).episodes == 0  # nothing comes twice
    assert _union_once(out, 3, answered)
    pruned = prune_exported(db, out).counts  # the late call was exported: nothing is kept
    assert (pruned.episodes, pruned.kept_late_calls) == (2, 0)
    assert not _sql(db, "SELECT 1 FROM calls") and not _sql(db, "SELECT 1 FROM call_intents")


@pytest.mark.parametrize("resolve", ["replay", "lost"])
def test_a_replica_that_never_returns_is_resolved_by_the_operator(
        engine, fresh_postgres, run_proxy, loop_thread, tmp_path, resolve):
    db, out = fresh_postgres, tmp_path / "out"
    a_dir, answered = _fault(engine, db, run_proxy, loop_thread, tmp_path)
    _first_export_holds_the_fault(db, out, answered)
    journal = a_dir / "journal"
    replica = (journal / "replica").read_text().strip()

    listing = _db_command(db, "replicas")
    assert replica in listing.stdout and "open" in listing.stdout
    # A replica that still renews its lease is running: the operator is stopped.
    running = _sql(db, "SELECT replica FROM replicas WHERE replica <> $1", replica)[0][0]
    refused = _db_command(db, "lost", running, ok=False)
    assert refused.returncode == 1 and "is running" in refused.stderr
    wait_until(lambda: _sql(db, "SELECT 1 FROM replicas WHERE replica = $1 AND heartbeat_at "
                                "< extract(epoch from now()) - $2", replica, STALE_SECONDS),
               "a's lease to go stale", 3 * STALE_SECONDS)
    if resolve == "replay":  # its volume was found: replayed from another host
        done = _db_command(db, "replay", str(journal))
        assert "replayed 1 records" in done.stdout and "1 calls" in done.stdout
    else:  # its journal is gone with it
        for segment in journal.glob("*.seg"):
            segment.unlink()
        done = _db_command(db, "lost", replica)
        assert "2 calls" in done.stdout
        answered.remove("split-journal-only")  # lost with the replica: marked, below
    assert export(db, out, incremental=True).held == 0
    split = "clean" if resolve == "replay" else "infra"
    assert _integrity(out, 1) == {"split": split, "cut": "infra"}
    statuses = _union_once(out, 2, answered)
    assert statuses["record_lost"] == (1 if resolve == "replay" else 2)
    assert _db_command(db, "replicas").stdout.count(" open ") == 2  # b and c


def _db_command(db: str, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "tracetap", "db", *args, "--db", db],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 or not ok, done.stderr
    return done


def test_a_replica_cut_off_from_the_database_holds_episodes_until_it_returns(
        engine, fresh_postgres, run_proxy, loop_thread, tmp_path):
    """The database is unreachable for replica a: the call it answers meanwhile cannot
    even leave its intent, so only a's lease (stopped at the outage) tells export to
    wait; a killed, then back: the call is exported once, with the rest."""
    db, out = fresh_postgres, tmp_path / "out"
    upgrade(db)
    forwarder = Forwarder(loop_thread, free_port())
    forwarder.start()
    a = run_proxy(engine.url, forwarder.route(db), data_dir=tmp_path / "a")
    b = run_proxy(engine.url, db, data_dir=tmp_path / "b")
    _ask(a.episode_url("e"), "e-0")
    _ask(b.episode_url("e"), "e-1")
    wait_until(lambda: _backlog(a) == 0, "e-0 to be stored", 30)
    forwarder.cut()
    _ask(a.episode_url("e"), "e-outage")  # 200: journaled; its intent cannot be stored
    a.signal(signal.SIGKILL)
    assert a.wait() == -signal.SIGKILL
    finish(b, "e")
    first = export(db, out, incremental=True)
    assert (first.episodes, first.held) == (0, 1)
    assert not _sql(db, "SELECT 1 FROM call_intents i WHERE NOT EXISTS "
                        "(SELECT 1 FROM calls c WHERE c.call_id = i.call_id)")

    forwarder.start()
    a = run_proxy(engine.url, forwarder.route(db), data_dir=tmp_path / "a")
    try:
        wait_until(lambda: _backlog(a) == 0, "a's journal to be replayed", 30)
        second = export(db, out, incremental=True)
        assert (second.episodes, second.held) == (1, 0)
        assert _integrity(out, 1) == {"e": "clean"}
        _union_once(out, 2, ["e-0", "e-1", "e-outage"])
    finally:
        a.stop()  # before its way to the database goes: the forwarder's sockets close
        forwarder.cut()
