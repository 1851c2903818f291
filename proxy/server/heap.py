"""Keep the memory a turn frees for the next turn, instead of handing it back at once.

An agentic turn allocates buffers the size of its context: the ~550 KB request, its
re-encoding with tracetap's fields, the ~380 KB first chunk with the prompt's ids, the
journal's record. glibc serves a block over its mmap threshold (128 KiB at start, raised
as such blocks are freed) from a fresh mapping and unmaps it on free, and trims the
heap's top once twice that is free. A conversation's buffers grow a little every turn,
so each turn's come from new pages, and the kernel faults every 4 KiB page in when it is
first touched: ~880 faults a turn at 72k tokens of context, ~2.7 µs each on this
project's virtual machines (nested paging; a few tenths of a µs on bare metal), ~1.9 ms
of CPU a turn that grows with the context (bench/agentic.py prints faults per turn).

With the threshold fixed at 32 MiB and the top trimmed only past 128 MiB free, those
buffers are carved from the heap and its pages reused turn after turn. The price is that
the process returns memory to the system later, after a peak well above a turn's size.
Where glibc is not the allocator, or the operator tuned malloc through the environment,
nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("tracetap")

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 128 << 20


def keep_freed_memory() -> bool:
    """Set glibc's thresholds as above; whether they were set."""
    if "GLIBC_TUNABLES" in os.environ or any(k.startswith("MALLOC_") for k in os.environ):
        return False  # the operator's own tuning wins
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it (musl has mallopt too)
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    done = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and done
    if not done:
        log.warning("could not set malloc thresholds; each turn's buffers fault in anew")
    return done
