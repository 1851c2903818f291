"""The merged trajectory token view: the exporter's trajectories, drawn a window at a time.

Rows come from ``exporters.trajectories.build_trajectories`` over the calls storage.scan
reads for the export, so what the page shows as trained is exactly what a trainer gets.
This module only lays them out: which call each stretch of tokens came from, which
window of tokens a page shows, and where a split row leaves the rows before it.
"""

from __future__ import annotations

import functools
from array import array
from typing import Any

import msgspec

from tracetap.exporters.annotate import page_notes
from tracetap.exporters.compaction import Compaction, bodies_of, segments
from tracetap.exporters.trajectories import Trajectory, build_trajectories
from tracetap.storage.scan import EpisodeFilter, Reader, ScannedCall

WINDOW = 2048
MAX_WINDOW = 8192
SHOWN_DIVERGING = 8  # tokens shown on each side of a split
OVERVIEW_BUCKETS = 200

REASONS = {
    None: "the episode's main line",
    "sample": "a later choice of the same request (n > 1): same prompt, another sample",
    "retry": "the same prompt was sent again (a retry): another answer to it",
    "branch": "a different continuation of a context seen before",
    "non_prefix": "the prompt does not extend any earlier completion: the harness rewrote, "
                  "summarised or replaced its context (or a sub-agent started)",
    "compaction": "the conversation compacted its history: this row starts over from a "
                  "summary an earlier call wrote, and continues the row it summarised",
    "no_token_ids": "the upstream returned no token ids for this call: a single-turn row, "
                    "never stitched to others",
}
# Logprob bands for colour: p >= 0.95, 0.6, 0.22, 0.05, lower.
BANDS = (-0.05, -0.5, -1.5, -3.0)


class Span(msgspec.Struct, kw_only=True):
    """One (call, choice) of a row: its completion is tokens [start, end)."""

    number: int  # 1-based turn in the row
    call_id: str
    seq: int
    choice: int
    start: int
    end: int
    trained: bool


class Split(msgspec.Struct, kw_only=True):
    reason: str
    position: int | None  # first token where this row differs from ``partner``
    partner: int | None  # index of the earlier row it shares the longest prefix with
    expected: list[int] = []  # the partner's tokens from ``position``
    received: list[int] = []  # this row's tokens from ``position``


class Row:
    """One trajectory, as full token arrays (prompt then response)."""

    def __init__(self, index: int, trajectory: Trajectory, calls: dict[str, ScannedCall]):
        t = trajectory
        self.index = index
        self.trajectory = t
        self.n_prompt = len(t.prompt_ids)
        self.ids = array("i", t.prompt_ids)
        self.ids.extend(t.response_ids)
        self.mask = bytes(self.n_prompt) + t.response_mask.tobytes()
        self.logprobs: array | None = None
        if t.response_logprobs is not None:
            self.logprobs = array("d", bytes(8 * self.n_prompt))
            self.logprobs.extend(t.response_logprobs)
        self.trained = self.mask.count(1)
        self.spans = list(_spans(t, calls, self.mask))
        self.split: Split | None = None
        self.continues: int | None = None  # a compaction row: the row it continues

    @property
    def total(self) -> int:
        return len(self.ids)

    @property
    def reason(self) -> str | None:
        return self.trajectory.split_reason


def _spans(t: Trajectory, calls: dict[str, ScannedCall], mask: bytes):
    for number, (call_id, index) in enumerate(zip(t.call_ids, t.choice_indices), 1):
        call = calls[call_id]
        choice = next(c for c in call.choices if c.index == index)
        start = len(call.prompt_ids or b"") // 4
        end = start + len(choice.completion_ids or b"") // 4
        yield Span(number=number, call_id=call_id, seq=call.seq, choice=index, start=start,
                   end=end, trained=end > start and mask[start] == 1)


async def episode_rows(reader: Reader, episode_id: str) -> tuple[list[Row], list[ScannedCall]]:
    """Every trajectory row of one episode, with splits located; and its calls."""
    calls: list[ScannedCall] = []
    scanned: list = []
    async for page in reader.episodes(EpisodeFilter(episode_ids=(episode_id,),
                                                    finished_only=False)):
        scanned.extend(page.rows)
        for episode in page.episodes:
            calls.extend(episode.calls)
    by_id = {c.call_id: c for c in calls}
    lineages = page_notes(scanned).lineages  # a sub-agent's rows are its own (lineages)
    build = functools.partial(build_trajectories, calls, keep_untokenized=True)
    # Compactions linked as the export links them: the summary call a lineage of its own,
    # the segment after it a "compaction" row that says which row it continues.
    built = await segments(calls, build(lineages=lineages), lineages, build,
                           bodies_of(reader, calls))
    rows = [Row(i, t, by_id) for i, t in enumerate(built)]
    by_trajectory = {r.trajectory.trajectory_id: r.index for r in rows}
    for row in rows:
        row.split = _split(row, rows)
        row.continues = by_trajectory.get(row.trajectory.continues_trajectory_id)
    return rows, calls


def compactions(rows: list[Row]) -> list[Compaction]:
    """The compactions the rows link (for the lineage tree: viewer.tree)."""
    return [Compaction(r.trajectory.call_ids[0], r.trajectory.summary_call_id) for r in rows
            if r.reason == "compaction" and r.trajectory.summary_call_id is not None]


def _split(row: Row, rows: list[Row]) -> Split | None:
    reason = row.reason
    if reason is None:
        return None
    if reason == "no_token_ids":
        return Split(reason=reason, position=None, partner=None)
    others = [r for r in rows if r is not row and r.reason != "no_token_ids"]
    earlier = [r for r in others if r.index < row.index] or others
    if not earlier:
        return Split(reason=reason, position=None, partner=None)
    mine = row.ids.tobytes()
    best = max(earlier, key=lambda r: (_common(mine, r.ids.tobytes()), -r.index))
    position = _common(mine, best.ids.tobytes())
    end = position + SHOWN_DIVERGING
    return Split(reason=reason, position=position, partner=best.index,
                 expected=list(best.ids[position:end]), received=list(row.ids[position:end]))


def _common(a: bytes, b: bytes) -> int:
    """Tokens (4 bytes each) the two arrays share from the start: binary search on memcmp."""
    low, high = 0, min(len(a), len(b)) // 4
    while low < high:
        mid = (low + high + 1) // 2
        if a[:4 * mid] == b[:4 * mid]:
            low = mid
        else:
            high = mid - 1
    return low


class Token(msgspec.Struct, array_like=True):
    kind: str  # CSS classes: p prompt, o observation, c model's but not trained here, s trained
    text: str
    newline: bool


class Marker(msgspec.Struct, kw_only=True):
    kind: str  # "turn", "response", "split"
    label: str
    span: Span | None = None


class Window(msgspec.Struct, kw_only=True):
    start: int
    end: int
    size: int
    pieces: list  # Token and Marker, in order
    data: dict[str, Any]  # for the page script: ids, logprobs, alternatives, spans


def window(row: Row, start: int, size: int, texts: dict[int, str],
           alternatives: dict[tuple[str, int], list]) -> Window:
    start = max(0, min(start, max(row.total - 1, 0)))
    end = min(row.total, start + size)
    model_made = _model_made(row, start, end)
    pieces = _pieces(row, start, end, model_made, _markers(row, start, end), texts)
    logprobs = row.logprobs
    data = {
        "start": start,
        "ids": list(row.ids[start:end]),
        "mask": list(row.mask[start:end]),
        "model": list(model_made),
        "lp": None if logprobs is None else [round(v, 5) for v in logprobs[start:end]],
        "alt": _alternatives(row, start, end, alternatives),
        "spans": [[s.start, s.end, s.number, s.seq, s.call_id, s.trained, s.choice]
                  for s in row.spans
                  if s.end > start and s.start < end],
        "nprompt": row.n_prompt,
    }
    return Window(start=start, end=end, size=size, pieces=pieces, data=data)


def _model_made(row: Row, start: int, end: int) -> bytearray:
    """1 where a token of [start, end) is inside a completion, trained here or not."""
    made = bytearray(end - start)
    for span in row.spans:
        lo, hi = max(span.start, start), min(span.end, end)
        if lo < hi:
            made[lo - start:hi - start] = b"\x01" * (hi - lo)
    return made


def _markers(row: Row, start: int, end: int) -> dict[int, list[Marker]]:
    """The labels drawn before a token: response start, each turn, the split point."""
    markers: dict[int, list[Marker]] = {}
    if row.n_prompt > 0 and start <= row.n_prompt < end:
        markers.setdefault(row.n_prompt, []).append(
            Marker(kind="response", label="response starts"))
    for span in row.spans:
        if start <= span.start < end:
            markers.setdefault(span.start, []).append(Marker(
                kind="turn", label=f"turn {span.number}: call {span.seq}"
                + ("" if span.trained else " (context here)"), span=span))
    split = row.split
    if split is not None and split.position is not None and start <= split.position < end:
        markers.setdefault(split.position, []).append(
            Marker(kind="split", label=f"split: {split.reason}"))
    return markers


def _pieces(row: Row, start: int, end: int, model_made: bytearray,
            markers: dict[int, list[Marker]], texts: dict[int, str]) -> list:
    pieces: list = []
    ids, mask, logprobs = row.ids, row.mask, row.logprobs
    for pos in range(start, end):
        pieces.extend(markers.get(pos, ()))
        token_id = ids[pos]
        if mask[pos]:
            kind = "s " + _band(logprobs[pos]) if logprobs is not None else "s"
        elif pos < row.n_prompt:
            kind = "p"
        else:
            kind = "c" if model_made[pos - start] else "o"
        text = texts.get(token_id)
        if text is None:
            pieces.append(Token(kind + " u", f"[{token_id}]", False))
        else:
            pieces.append(Token(kind, text, "\n" in text))
    return pieces


def _band(logprob: float) -> str:
    for i, bound in enumerate(BANDS):
        if logprob >= bound:
            return f"l{i}"
    return f"l{len(BANDS)}"


def _alternatives(row: Row, start: int, end: int,
                  alternatives: dict[tuple[str, int], list]) -> dict[str, list]:
    out: dict[str, list] = {}
    for span in row.spans:
        tops = alternatives.get((span.call_id, span.choice))
        if not tops:
            continue
        for pos in range(max(span.start, start), min(span.end, end)):
            entry = tops[pos - span.start] if pos - span.start < len(tops) else None
            pairs = _pairs(entry)
            if pairs:
                out[str(pos)] = pairs
    return out


def _pairs(entry: Any) -> list:
    """Alternatives as [text, logprob]: chat/Responses lists of {token, logprob}, or the
    completions API's {token: logprob}."""
    if isinstance(entry, dict):
        return [[str(k), v] for k, v in entry.items() if isinstance(v, (int, float))]
    if isinstance(entry, list):
        return [[str(e.get("token")), e.get("logprob")] for e in entry
                if isinstance(e, dict) and isinstance(e.get("logprob"), (int, float))]
    return []


def overview(row: Row, size: int, current: int) -> list[dict[str, Any]]:
    """One bucket per window (merged when there are many): trained share, split, current."""
    windows = max(1, -(-row.total // size))
    per_bucket = max(1, -(-windows // OVERVIEW_BUCKETS))
    split_at = row.split.position if row.split is not None else None
    out = []
    for b in range(0, windows, per_bucket):
        lo, hi = b * size, min(row.total, (b + per_bucket) * size)
        share = row.mask[lo:hi].count(1) / max(hi - lo, 1)
        out.append({"start": lo, "end": hi, "share": share,
                    "split": split_at is not None and lo <= split_at < hi,
                    "current": lo <= current < hi})
    return out
