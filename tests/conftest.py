"""Loads the shared fixtures and sets Hypothesis' profile; what the tests share lives in
tests/helpers/ (import it from there: ``from helpers.servers import Proxy``).

Servers run on an event loop in a background thread so tests can drive them with the
real (sync or async) ``openai`` SDK. Storage tests run against the real Postgres on
127.0.0.1:5432; they skip only when it is unreachable and CI is not set.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

pytest_plugins = ["helpers.databases", "helpers.servers", "helpers.seeding"]

# The suite runs on a shared 2-core machine where other jobs can stall this process for
# a second or more: Hypothesis' default 200 ms deadline would measure that load, and a
# slow first run that is fast on replay fails as "unreliable timings". The deadline stays,
# but at 5 s: an example that slow is pathological, not unlucky. HYPOTHESIS_PROFILE=default
# restores Hypothesis' own settings.
settings.register_profile("shared-2-core", deadline=5000,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "shared-2-core"))
