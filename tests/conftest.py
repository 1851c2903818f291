"""Loads the shared fixtures and sets Hypothesis' profile; what the tests share lives in
tests/helpers/ (import it from there: ``from helpers.servers import Proxy``).

Servers run on an event loop in a background thread so tests can drive them with the
real (sync or async) ``openai`` SDK. Storage tests run against the real Postgres on
127.0.0.1:5432; they skip only when it is unreachable and CI is not set.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings

_OWN_BASETEMP = pytest.StashKey[str]()

pytest_plugins = ["helpers.databases", "helpers.servers", "helpers.seeding", "helpers.hostile"]

# The suite runs on a shared 2-core machine where other jobs can stall this process for
# a second or more: Hypothesis' default 200 ms deadline would measure that load, and a
# slow first run that is fast on replay fails as "unreliable timings". The deadline stays,
# but at 5 s: an example that slow is pathological, not unlucky. HYPOTHESIS_PROFILE=default
# restores Hypothesis' own settings.
settings.register_profile("shared-2-core", deadline=5000,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "shared-2-core"))


# Each test's tmp_path on tmpfs where there is one: the suite starts about a thousand
# SQLite databases, journals and data dirs, and on this machine's disk every migration
# step's commit waits for an fsync (a migrated database took 0.2 s idle, over a second
# under load; on tmpfs a few ms). Nothing in the tests needs the disk: a killed process
# leaves its files on tmpfs just as on disk. --basetemp still chooses another place.
_SHM = "/dev/shm"


def pytest_configure(config):
    if config.option.basetemp is None and os.access(_SHM, os.W_OK):
        config.option.basetemp = tempfile.mkdtemp(prefix="tracetap-tests-", dir=_SHM)
        config.stash[_OWN_BASETEMP] = config.option.basetemp


def pytest_unconfigure(config):
    own = config.stash.get(_OWN_BASETEMP, None)
    if own is not None:
        shutil.rmtree(own, ignore_errors=True)  # RAM: not left for the next run
