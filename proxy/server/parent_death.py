"""A worker told by the kernel that its supervisor died (Linux ``PR_SET_PDEATHSIG``),
where it asked ``getppid`` every second: an idle worker then has no timer for it.

``notify_on_parent_death(signum)`` asks for ``signum`` at the parent's death; False
where the kernel cannot (not Linux), and the caller keeps its timer.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def notify_on_parent_death(signum: int) -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):  # no prctl: not Linux
        return False
