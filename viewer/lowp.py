"""Low-probability tokens of one trajectory row: where they are, the lowest, each turn's mean.

A researcher reading a 200,000-token row wants the few tokens the policy found unlikely,
not 98 windows of colour. Only trained tokens (mask 1) count: they are what the update
sees. Everything here is computed over the whole row, once per (row, threshold, k), and
kept on the Row (rows live in the viewer's RowCache, so paging costs nothing more).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
from collections.abc import Mapping
from itertools import compress
from urllib.parse import urlencode

import msgspec

from tracetap.viewer.params import BadParameter
from tracetap.viewer.tokens import Row

DEFAULT_P = 0.2  # "low" below this probability, unless the page asks for another
DEFAULT_K = 10
MAX_K = 100
STRIP_BUCKETS = 240


class Low(msgspec.Struct, kw_only=True):
    position: int
    logprob: float
    token_id: int
    turn: int | None  # 1-based turn of the row it was sampled in

    @property
    def p(self) -> float:
        return math.exp(self.logprob)


class TurnMean(msgspec.Struct, kw_only=True):
    number: int
    call_id: str
    seq: int
    tokens: int  # trained tokens with a logprob
    mean: float | None
    lowest: float | None
    below: int  # tokens below the threshold


class Bucket(msgspec.Struct, kw_only=True):
    start: int
    end: int
    below: int
    first: int | None  # the first low token in it (where its link goes)


class Summary(msgspec.Struct, kw_only=True):
    p: float
    threshold: float  # ln(p)
    k: int
    below: int  # trained tokens below the threshold in the whole row
    lowest: list[Low]  # the k lowest trained tokens, lowest first
    turns: list[TurnMean]
    strip: list[Bucket]
    peak: int  # the most low tokens in one bucket (the strip's scale)
    previous: int | None = None  # the nearest low token before the window
    next: int | None = None  # ... and after it

    @property
    def ids(self) -> list[int]:
        return [low.token_id for low in self.lowest]


def token_ids(low: Summary | None) -> list[int]:
    """The ids whose text the page shows (the lowest tokens'), none without a summary."""
    return [] if low is None else low.ids


class _Whole(msgspec.Struct):
    """What does not depend on the window: computed once per row and threshold."""

    positions: list[int]  # every low trained token, in order
    lowest: list[Low]
    turns: list[TurnMean]
    strip: list[Bucket]


def options(query: Mapping[str, str]) -> tuple[float, int]:
    """The page's threshold probability ``p`` and how many lowest tokens ``k`` to list."""
    try:
        p = float(query.get("p") or DEFAULT_P)
        k = int(query.get("k") or DEFAULT_K)
    except ValueError:
        raise BadParameter("p must be a probability and k an integer") from None
    if not 0 < p < 1:
        raise BadParameter("p must be a probability between 0 and 1 (exclusive)")
    return p, max(1, min(k, MAX_K))


def summary(row: Row, start: int, end: int, p: float, k: int) -> Summary | None:
    """Low tokens of ``row`` for a window [start, end); None without logprobs."""
    if row.logprobs is None:
        return None
    threshold = math.log(p)
    whole = _whole(row, threshold, k)
    before = bisect_left(whole.positions, start)
    after = bisect_right(whole.positions, end - 1)
    return Summary(
        p=p, threshold=threshold, k=k, below=len(whole.positions), lowest=whole.lowest,
        turns=whole.turns, strip=whole.strip, peak=max((b.below for b in whole.strip), default=0),
        previous=whole.positions[before - 1] if before > 0 else None,
        next=whole.positions[after] if after < len(whole.positions) else None)


def _whole(row: Row, threshold: float, k: int) -> _Whole:
    # Kept on the row: a row is immutable once built, and the RowCache drops it (and
    # this with it) when the episode changes.
    memo: dict = row.__dict__.setdefault("_lowp", {})
    key = (threshold, k)
    if key not in memo:
        memo.clear()  # one threshold at a time: a page asks for one
        memo[key] = _compute(row, threshold, k)
    return memo[key]


def _compute(row: Row, threshold: float, k: int) -> _Whole:
    # compress/nsmallest run in C: about 20 ms of CPU for 100,000 trained tokens.
    lp, mask = row.logprobs, row.mask
    trained = list(compress(range(row.n_prompt, row.total), mask[row.n_prompt:]))
    positions = [i for i in trained if lp[i] < threshold]
    smallest = heapq.nsmallest(k, trained, key=lp.__getitem__)
    turn_of = _turn_finder(row)
    lowest = [Low(position=i, logprob=lp[i], token_id=row.ids[i], turn=turn_of(i))
              for i in smallest]
    return _Whole(positions, lowest, _turn_means(row, positions), _strip(row, positions))


def _turn_finder(row: Row):
    starts = [s.start for s in row.spans]

    def turn(position: int) -> int | None:
        at = bisect_right(starts, position) - 1
        if at >= 0 and row.spans[at].start <= position < row.spans[at].end:
            return row.spans[at].number
        return None

    return turn


def _turn_means(row: Row, positions: list[int]) -> list[TurnMean]:
    lp, mask = row.logprobs, row.mask
    out = []
    for span in row.spans:
        values = list(compress(lp[span.start:span.end], mask[span.start:span.end]))
        out.append(TurnMean(
            number=span.number, call_id=span.call_id, seq=span.seq, tokens=len(values),
            mean=math.fsum(values) / len(values) if values else None,
            lowest=min(values) if values else None,
            below=bisect_left(positions, span.end) - bisect_left(positions, span.start)))
    return out


def _strip(row: Row, positions: list[int]) -> list[Bucket]:
    """The whole row in at most STRIP_BUCKETS stretches, each with its low tokens."""
    width = max(1, -(-row.total // STRIP_BUCKETS))
    buckets = [Bucket(start=lo, end=min(row.total, lo + width), below=0, first=None)
               for lo in range(0, row.total, width)]
    for position in positions:
        bucket = buckets[position // width]
        bucket.below += 1
        if bucket.first is None:
            bucket.first = position
    return buckets


def window_start(position: int, size: int) -> int:
    """The window a link to ``position`` opens: aligned, as the page's own pager is."""
    return position - position % size


LINK_FIELDS = ("t", "at", "n", "p", "k", "sel")


def linker(query: Mapping[str, str], size: int):
    """``href(**changes)``: this episode page's query with some fields changed; a ``sel``
    (a token to select) without ``at`` opens the window that holds it."""

    def href(**changes: int | float | str | None) -> str:
        sel = changes.get("sel")
        if isinstance(sel, int) and "at" not in changes:
            changes["at"] = window_start(sel, size)
        merged = {name: query.get(name, "") for name in LINK_FIELDS}
        for name, value in changes.items():
            merged[name] = "" if value is None else str(value)
        return "?" + urlencode({name: v for name, v in merged.items() if v})

    return href
