"""Policy versions in the export: per-token runs, the ``mixed_policy`` flag, and the mask
the trainer adapters apply on request.

Storage keeps a choice's versions as ``(start, version)`` spans (storage.policy_spans;
none stored = one span of the call's version). The export writes them as ``[start,
end)`` runs: ``calls.policy_spans`` over the choice's ``completion_ids``,
``trajectories.response_policy_spans`` over ``response_ids``, where only the model's
completions are covered (observation tokens are in no run). A run's ``version`` is null
when the version is unknown: the tokens arrived during a weight sync.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tracetap.storage.policy_spans import mixed, spans_of

Run = dict[str, Any]  # {"start", "end", "version"}

# What an adapter keeps of the trained tokens (``policy=``): every one ("keep", the
# default); those of a known version ("known"); those of the row's newest known version
# ("latest": the row's last trained run with a version); or any other string, the
# tokens of exactly that version. The rest are masked (mask 0), never dropped: the
# sequence stays whole for the trainer's context.
POLICY_CHOICES = ("keep", "known", "latest")


def runs(stored: str | list | None, version: str | None, length: int,
         offset: int = 0) -> list[Run]:
    """A completion of ``length`` tokens as ``[start, end)`` runs, shifted by ``offset``."""
    spans = [s for s in spans_of(stored, version, length) if s[0] < length]
    if not spans:
        return []
    ends = [start for start, _ in spans[1:]] + [length]
    return [{"start": offset + start, "end": offset + end, "version": v}
            for (start, v), end in zip(spans, ends, strict=True)]


def call_spans(columns: Mapping[str, Sequence]) -> dict[str, list]:
    """The calls dataset's two columns from scanned columns (storage.scan.ROW)."""
    spans, flags = [], []
    for index, stored, version, ids in zip(columns["choice_index"], columns["policy_spans"],
                                           columns["policy_version"],
                                           columns["completion_ids"], strict=True):
        if index is None:  # a call without a choice
            spans.append(None)
            flags.append(None)
            continue
        length = 0 if ids is None else len(ids) // 4
        row = runs(stored, version, length)
        spans.append(row)
        flags.append(mixed((r["start"], r["version"]) for r in row))
    return {"policy_spans": spans, "mixed_policy": flags}


def trajectory_runs(turns: Iterable[tuple[Any, Any, int, int, bool]]) -> tuple[list[Run], bool]:
    """A row's runs and ``mixed_policy`` from its turns: (call, choice, completion
    offset in response_ids, completion length, trained in this row)."""
    out: list[Run] = []
    trained: set[str | None] = set()
    for call, choice, offset, length, is_trained in turns:
        row = runs(getattr(choice, "policy_spans", None), call.policy_version, length, offset)
        out.extend(row)
        if is_trained:
            trained.update(r["version"] for r in row)
    return out, len(trained) > 1 or None in trained


def policy_mask(row: Mapping[str, Any], policy: str = "keep") -> list[int]:
    """``response_mask`` with the trained tokens that ``policy`` does not keep set to 0."""
    mask = [int(v) for v in row["response_mask"]]
    if policy == "keep":
        return mask
    spans = list(row.get("response_policy_spans") or ())
    keep = _wanted(spans, mask, policy)
    for run in spans:
        if not keep(run["version"]):
            mask[run["start"]:run["end"]] = [0] * (run["end"] - run["start"])
    return mask


def _wanted(spans: list[Run], mask: list[int], policy: str):
    if policy == "known":
        return lambda version: version is not None
    if policy == "latest":
        known = [r["version"] for r in spans
                 if r["version"] is not None and any(mask[r["start"]:r["end"]])]
        newest = known[-1] if known else None
        return lambda version: version is not None and version == newest
    return lambda version: version == policy
