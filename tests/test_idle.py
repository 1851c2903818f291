"""An idle replica costs almost nothing, and still follows the others at once.

Nothing wakes an idle proxy on a timer it does not need: the writer sleeps until a record
comes (storage/writer.py), the shared controls, registrations and patches are read when
their change notice arrives (storage/notify.py; on SQLite when the kernel says the
database's files changed), with a slow poll besides, and the replica's lease is one
prepared statement a second (storage/lease_sql.py). The CPU is the process's own
(schedstat from /proc), not wall time, so a loaded machine does not make it fail.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import openai
import pytest
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.proxy.policy.controls import IDLE_POLL_SECONDS
from tracetap.proxy.runtime.settings import Settings

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

TOKEN = "i" * 40
# The bound is the target, 0.2% of a core (2 ms of CPU a second). Idle proxies measure
# 0.05-0.16% on the 2-core test machine at load averages of 2-4 (they measured 0.27-0.35%
# before their lease, followers and SQLite ticks were made cheap or woken by events).
# A window over the bound is measured once more (another process's burst can evict the
# caches an idle proxy's few wake-ups then miss); the smaller share counts.
IDLE_BOUND = 0.002
MEASURE_SECONDS = 10.0
WINDOWS = 2


def _cpu_seconds(pid: int) -> float:
    """CPU of every thread of ``pid`` so far, from schedstat (nanoseconds: /proc/<pid>/stat
    counts 10 ms ticks, 0.1% of a core over 10 s)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def test_an_idle_replica_uses_under_a_fifth_of_a_percent_of_a_core(engine, migrated_postgres,
                                                                   run_proxy):
    proxy = run_proxy(engine.url, migrated_postgres, "--admin-token", TOKEN)
    assert _idle_share(proxy) <= IDLE_BOUND


def test_an_idle_sqlite_proxy_uses_under_a_fifth_of_a_percent_of_a_core(engine, run_proxy,
                                                                        tmp_path):
    # SQLite's notices are serials in the database: one watcher reads them when the
    # database's files change (inotify; storage/notify.py) and wakes only the followers
    # whose topic moved (a heartbeat moves none).
    proxy = run_proxy(engine.url, f"sqlite:///{tmp_path / 'idle.db'}", "--admin-token", TOKEN)
    assert _idle_share(proxy) <= IDLE_BOUND


def _idle_share(proxy) -> float:
    # It has served: a registration and a call went through the writer and the follower.
    assert proxy.admin("POST", "/tracetap/episodes", {"id": "idle"})[0] == 201
    _ask(openai.OpenAI(base_url=proxy.episode_url("idle"), api_key="x",
                       max_retries=0))
    time.sleep(1.0)  # the record written, start-up work done
    pid = proxy.process.pid
    shares = []
    while len(shares) < WINDOWS and (not shares or shares[-1] > IDLE_BOUND):
        before, started = _cpu_seconds(pid), time.monotonic()
        time.sleep(MEASURE_SECONDS)
        shares.append((_cpu_seconds(pid) - before) / (time.monotonic() - started))
    print("idle proxy used " + ", ".join(f"{share:.2%}" for share in shares) + " of a core")
    return min(shares)


@pytest.fixture
def two_replicas(loop_thread, engine, migrated_postgres, tmp_path):
    replicas = [Proxy(loop_thread, Settings(
        upstream=engine.url, db=migrated_postgres, data_dir=str(tmp_path / name),
        port=free_port(), admin_token=TOKEN)).start() for name in ("a", "b")]
    yield replicas
    for replica in replicas:
        replica.stop()


def _within(seconds: float, condition) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < seconds, "not within the time"
        time.sleep(0.01)  # polling the other replica's state
    return time.monotonic() - started


def test_a_pause_and_a_registration_reach_an_idle_replica_at_once(two_replicas):
    a, b = two_replicas
    # Both listen for notices: the slow poll is what an idle replica runs.
    _within(10, lambda: a.state.controls.notices.live and b.state.controls.notices.live)
    time.sleep(0.5)  # both are waiting on their slow poll now
    assert a.admin("POST", "/tracetap/pause", {"timeout": 5})[0] == 200
    took = _within(IDLE_POLL_SECONDS / 2, lambda: b.state.gate.paused)
    assert took < 1.0, took
    assert a.admin("POST", "/tracetap/resume", {"policy_version": "v9"})[0] == 200
    _within(1.0, lambda: not b.state.gate.paused)
    assert b.state.controls.policy_version == "v9"
    # An id b served unregistered is registered on a: b refuses its keyless calls as soon
    # as the registration's notice arrives, not at its next slow poll.
    assert b.state.tagger.following
    keyless = openai.OpenAI(base_url=f"{b.url}/episodes/late/v1", api_key="x",
                            max_retries=0)
    _ask(keyless)
    assert a.admin("POST", "/tracetap/episodes", {"id": "late"})[0] == 201
    _within(1.0, lambda: _refused(keyless))


def _ask(client: openai.OpenAI) -> None:
    client.chat.completions.create(model="mock-model", max_tokens=1,
                                   messages=[{"role": "user", "content": "hi"}])


def _refused(client: openai.OpenAI) -> bool:
    try:
        _ask(client)
    except openai.PermissionDeniedError:
        return True
    return False
