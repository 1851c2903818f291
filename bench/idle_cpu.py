"""A process's CPU while it serves nothing: its periodic background work alone.

    idle_ms_per_s([pid], seconds=5.0)   # ms of CPU per second, all its threads and children

Read from /proc/<pid>/task/*/schedstat (nanoseconds), so a few seconds resolve the
~1 ms a second a proxy's timers and heartbeats cost (1 ms/s = 0.1% of a core).
"""

from __future__ import annotations

import time

from agentic_load import cpu_ns


def idle_ms_per_s(pids: list[int], seconds: float = 5.0) -> float:
    """CPU ms per wall second of ``pids`` (and their descendants) over ``seconds``."""
    start, began = cpu_ns(pids), time.perf_counter()
    time.sleep(seconds)
    return (cpu_ns(pids) - start) / 1e6 / (time.perf_counter() - began)


def idle_all(pids: dict[str, list[int]], seconds: float = 5.0) -> dict[str, float]:
    """The same for several processes over the same seconds (all idle at once)."""
    start = {name: cpu_ns(p) for name, p in pids.items()}
    began = time.perf_counter()
    time.sleep(seconds)
    wall = time.perf_counter() - began
    return {name: (cpu_ns(p) - start[name]) / 1e6 / wall for name, p in pids.items()}
