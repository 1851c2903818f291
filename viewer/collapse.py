"""A long episode's calls, collapsed: the first, the last and every failed one, with
the number left out between them, so the token view is reached at once (a 200-call
table was 7,739 px tall). ``?calls=all`` lists them all."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

COLLAPSE_ABOVE = 12  # episodes with more calls than this are collapsed
MAX_FAILED = 50  # failed calls listed at most (the rest are counted in the gaps)


class Gap(msgspec.Struct, frozen=True):
    hidden: int  # calls left out here


def collapsed(calls: Sequence[Any], everything: bool = False) -> list:
    """The calls to list, in order, with a Gap where some are left out."""
    if everything or len(calls) <= COLLAPSE_ABOVE:
        return list(calls)
    failed = [i for i, c in enumerate(calls) if c.failed][:MAX_FAILED]
    keep = sorted({0, len(calls) - 1, *failed})
    out: list = []
    previous = -1
    for i in keep:
        if i - previous > 1:
            out.append(Gap(hidden=i - previous - 1))
        out.append(calls[i])
        previous = i
    return out
