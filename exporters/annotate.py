"""What export adds to a page's rows beyond the stored columns: each episode's integrity
verdict (storage.integrity) and each call's lineage (exporters.lineages).

Read from the page's rows (storage.scan.ROW), so the calls dataset gets them without
building call structs, and both datasets agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from tracetap.exporters.lineages import TOOL_FINISH, CallView, Lineage, assign
from tracetap.storage.integrity import CLEAN_VERDICT, Verdict, cause_of, verdict
from tracetap.storage.parents import first_calls
from tracetap.storage.scan import COLUMN, ScanPage

C = COLUMN


class PageNotes(msgspec.Struct, gc=False):
    verdicts: dict[str, Verdict]  # episode id → its verdict
    lineages: dict[str, Lineage]  # call id → its lineage (calls of an episode only)
    causes: dict[str, str]  # call id → its own cause, for calls that show one

    def verdict(self, episode_id: str | None) -> Verdict:
        return self.verdicts.get(episode_id, CLEAN_VERDICT)

    def lineage_ids(self, call_id: str) -> tuple[str | None, str | None]:
        found = self.lineages.get(call_id)
        return (None, None) if found is None else (found.id, found.parent)

    def lineage_rows(self, row):
        """``row`` (a Trajectory) with the lineage of its leaf call."""
        row.lineage_id, row.parent_lineage_id = self.lineage_ids(row.call_ids[-1])
        return row


def page_notes(rows: Sequence[tuple]) -> PageNotes:
    """Verdicts and lineages of the episodes in ``rows`` (arrival order per episode, a
    call's choices adjacent, as a scan gives them)."""
    causes: dict[str, str] = {}
    by_episode: dict[str, list[CallView]] = {}
    last: CallView | None = None
    for row in rows:
        call_id = row[C.call_id]
        if last is not None and last.call_id == call_id:
            last.asked_tool = last.asked_tool or row[C.finish_reason] in TOOL_FINISH
            continue
        cause = cause_of(row[C.status], row[C.http_status], row[C.ids_missing])
        if cause is not None:
            causes[call_id] = cause
        last = CallView(call_id=call_id, t_start=row[C.t_start], t_end=row[C.t_end],
                        conversation=row[C.conversation], lineage=row[C.lineage],
                        parent_lineage=row[C.parent_lineage],
                        asked_tool=row[C.finish_reason] in TOOL_FINISH)
        if row[C.episode_id] is not None:
            by_episode.setdefault(row[C.episode_id], []).append(last)
    lineages: dict[str, Lineage] = {}
    verdicts: dict[str, Verdict] = {}
    for episode_id, calls in by_episode.items():
        lineages.update(assign(calls))
        verdicts[episode_id] = verdict((causes.get(c.call_id), 1) for c in calls)
    return PageNotes(verdicts, lineages, causes)


def without_infra(page: ScanPage, notes: PageNotes) -> tuple[ScanPage, int]:
    """The page without its episodes whose verdict is infra, and how many those were."""
    infra = {e.id for e in page.episodes if notes.verdict(e.id).infra}
    if not infra:
        return page, 0
    episode_id = C.episode_id
    return ScanPage([e for e in page.episodes if e.id not in infra],
                    [r for r in page.rows if r[episode_id] not in infra]), len(infra)


async def adopt(engine, page: ScanPage, notes: PageNotes) -> None:
    """Root lineages of sub-agent episodes (registered with ``parent``) get the parent
    episode's root lineage (its first call) as their parent."""
    parents = {e.id: e.parent_id for e in page.episodes if e.parent_id is not None}
    if not parents:
        return
    first = await first_calls(engine, list(parents.values()))
    episode_id = C.episode_id
    for row in page.rows:
        parent = first.get(parents.get(row[episode_id]))
        lineage = notes.lineages.get(row[C.call_id])
        if parent is not None and lineage is not None and lineage.parent is None:
            lineage.parent = parent
