"""Credentials hidden in the token view, by the rule of storage.credentials.

The token view draws the tokens the model saw, one span each: a credential the agent
put in its prompt would be readable there, split into tokens. The window's tokens are
joined into their text (with ``MARGIN`` tokens either side, so a value that starts or
ends beyond the window is still seen whole), the values after credential names are found
there (``storage.credentials.value_spans``), and every token overlapping one is hidden:
its text drawn as ``MARK``, its id and alternatives left out of the page's data. The
token stays in place, so positions, counts and navigation are unchanged.

Without the engine's token texts nothing can be read, and ids are shown as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from tracetap.storage.credentials import value_spans

MARK = "•"  # a hidden token's text (one per token: positions stay)
TITLE = "hidden: part of a credential"
MARGIN = 96  # tokens read either side of a range (a key before, the rest of a value after)


def around(ids: Sequence[int], start: int, end: int) -> Sequence[int]:
    """The ids whose texts ``hidden`` needs for [start, end)."""
    return ids[max(0, start - MARGIN):min(len(ids), end + MARGIN)]


def hidden(ids: Sequence[int], ranges: Iterable[tuple[int, int]],
           texts: Mapping[int, str]) -> set[int]:
    """Positions of ``ids`` inside [start, end) of ``ranges`` that belong to a
    credential's value."""
    out: set[int] = set()
    for start, end in _merged(ranges, len(ids)):
        lo, hi = max(0, start - MARGIN), min(len(ids), end + MARGIN)
        offsets, parts, at = [], [], 0
        for pos in range(lo, hi):
            text = texts.get(ids[pos], "\x00")  # an id without text: one character
            offsets.append(at)
            parts.append(text)
            at += len(text)
        offsets.append(at)
        spans = value_spans("".join(parts))
        if not spans:
            continue
        for pos in range(max(start, lo), min(end, hi)):
            a, b = offsets[pos - lo], offsets[pos - lo + 1]
            if any(a < s_end and s_start < b for s_start, s_end in spans):
                out.add(pos)
    return out


def _merged(ranges: Iterable[tuple[int, int]], total: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted((max(0, s), min(total, e)) for s, e in ranges):
        if start >= end:
            continue
        if out and start <= out[-1][1] + MARGIN:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def apply(window, hide: set[int]) -> None:
    """A window (viewer.tokens.Window) with the tokens at ``hide`` drawn as MARK, their
    ids (None) and alternatives left out of its data."""
    if not hide:
        return
    start, data, k = window.start, window.data, 0
    for piece in window.pieces:
        if getattr(piece, "label", None) is not None:
            continue  # a marker
        if start + k in hide:
            piece.kind = piece.kind.replace(" u", "") + " h"
            piece.text, piece.newline = MARK, False
        k += 1
    ids = data["ids"]
    for pos in hide:
        if start <= pos < start + len(ids):
            ids[pos - start] = None
        data["alt"].pop(str(pos), None)


def ids_needed(row, at: int, size: int, low) -> list[int]:
    """Every id whose text the page's masking reads (viewer.pages.episode)."""
    out = list(around(row.ids, at, at + size))
    for position in _low_positions(low):
        out.extend(around(row.ids, position, position + 1))
    return out


def _low_positions(low) -> list[int]:
    return [x.position for x in low.lowest] if low is not None else []


def on_page(row, rows: list, at: int, size: int, low, texts: Mapping[int, str]) -> dict:
    """What the episode page hides: ``row`` (positions of the row: window, lowest tokens,
    the split's received tokens) and ``partner`` (the split's expected tokens, positions
    of the row it split from)."""
    ranges = [(at, at + size), *((p, p + 1) for p in _low_positions(low))]
    split, partner = row.split, set()
    if split is not None and split.position is not None:
        end = split.position + len(split.received)
        ranges.append((split.position, end))
        other = rows[split.partner]
        partner = hidden(other.ids, [(split.position, split.position + len(split.expected))],
                         texts)
    return {"row": hidden(row.ids, ranges, texts), "partner": partner}
