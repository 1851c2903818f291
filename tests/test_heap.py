"""proxy/server/heap.py: a growing conversation's buffers reuse the heap's pages turn after turn
instead of faulting fresh ones in (each a few µs on a virtual machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# A turn as the proxy sees it: buffers the size of the context, each turn a little
# larger than the last (the request, a copy of it, the first chunk), then freed.
TURNS = """
import json, resource, sys
from tracetap.proxy.server import heap
kept = heap.keep_freed_memory()
def turn(i):
    n = 550_000 + i * 20_000
    a = b"x" * n
    b = bytearray(a)
    c = b"z" * (n * 2 // 3)
    return len(a) + len(b) + len(c)
turn(0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(1, 31):
    turn(i)
after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(json.dumps({"kept": kept, "faults_per_turn": (after - before) / 30}))
"""


def _run(env: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"} | env
    out = subprocess.run([sys.executable, "-c", TURNS], env=env, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return json.loads(out)


def test_growing_buffers_reuse_the_heap_instead_of_faulting_in_new_pages():
    kept = _run({})
    assert kept["kept"] is True
    # ~1.2 MiB of buffers a turn is ~300 pages: nearly all of them reused.
    assert kept["faults_per_turn"] < 30, kept


def test_the_operators_own_malloc_tuning_is_left_alone():
    tuned = _run({"MALLOC_ARENA_MAX": "4"})
    assert tuned["kept"] is False
    # glibc's defaults: each turn's larger buffers come from fresh mappings.
    assert tuned["faults_per_turn"] > 150, tuned
