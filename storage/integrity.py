"""The reward trust verdict: whether an episode's outcome can be blamed on its harness.

An episode is ``clean`` unless one of its stored calls shows an infrastructure cause
(below); then it is ``infra``, with the causes and how many calls had each. The verdict
is computed from the stored calls whenever it is read (export, viewer, analysis, the
finish metric), never stored: it stays true after a crash, a replayed journal or a late
call, and rows stored before it existed get one too.

What never reaches the database as a call still leaves a row: a record dropped because
the journal was full, or refused by the database and kept in the dead-letter file, is
stored as a small *tombstone* call (status ``record_dropped`` / ``record_quarantined``,
``storage.tombstones``) of its episode, so the verdict sees it like any other call.

Causes, by a call's status (``storage.records.STATUSES``) and HTTP status:

==================== =====================================================================
upstream_error       the upstream failed, was unreachable, broke mid-reply, or answered
                     5xx or 429 (a 4xx such as "context too long" is the harness's)
upstream_timeout     the upstream did not answer in time
refused              the proxy refused the request (bad_request: body too large or too
                     slow, not JSON, untranslatable)
paused               held at a weight-sync pause past its timeout
budget_exceeded      the episode's calls / tokens / seconds budget refused it
overlay_failed       an overlay hook failed under --overlay-fail closed
proxy_error          the proxy failed on the request itself (500 internal_error)
client_disconnected  the client went away mid-reply
no_token_ids         stored without usable token ids (``ids_missing``)
record_dropped       its record was lost: the journal was full (a tombstone)
record_quarantined   its record was refused by the database (a tombstone; the record is
                     in the dead-letter file)
record_lost          its replica was admitting it when it died, or was declared lost
                     (a tombstone, storage.intents)
==================== =====================================================================

An attempt a weight sync cut and sent again (``weight_sync_retried``) is no cause: the
agent's answer is its retry's, which is judged as any call.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
from sqlalchemy import func, or_, select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tracetap.storage.fetch import among, fetch
from tracetap.storage.tables import FAILED_SQL, Call

CLEAN = "clean"
INFRA = "infra"
INTEGRITY = (CLEAN, INFRA)
CAUSES = ("upstream_error", "upstream_timeout", "refused", "paused", "budget_exceeded",
          "overlay_failed", "proxy_error", "client_disconnected", "no_token_ids",
          "record_dropped", "record_quarantined", "record_lost")

_BY_STATUS = {
    "upstream_error": "upstream_error",
    "upstream_unreachable": "upstream_error",
    "upstream_timeout": "upstream_timeout",
    "bad_request": "refused",
    "paused": "paused",
    "budget_exceeded": "budget_exceeded",
    "overlay_failed": "overlay_failed",
    "error": "proxy_error",
    "client_disconnected": "client_disconnected",
    "record_dropped": "record_dropped",
    "record_quarantined": "record_quarantined",
    "record_lost": "record_lost",
}
# Statuses whose HTTP status is the upstream's own answer.
_ANSWERED = ("ok", "passthrough", "vetoed")


class Verdict(msgspec.Struct, frozen=True, gc=False):
    """``integrity``: clean or infra; ``causes``: {cause: calls}, empty when clean."""

    integrity: str = CLEAN
    causes: dict[str, int] = {}

    @property
    def infra(self) -> bool:
        return self.integrity == INFRA

    def describe(self) -> str:
        """``clean``, or ``infra: upstream_error (2), no_token_ids (1)``."""
        if not self.causes:
            return self.integrity
        return f"{self.integrity}: " + ", ".join(f"{c} ({n})" for c, n in self.causes.items())


CLEAN_VERDICT = Verdict()


def cause_of(status: str, http_status: int, ids_missing: str | None = None) -> str | None:
    """The infrastructure cause a stored call shows, or None."""
    if status in _ANSWERED:
        if http_status >= 500 or http_status == 429:
            return "upstream_error"
        if status == "ok" and ids_missing:
            return "no_token_ids"
        return None
    return _BY_STATUS.get(status)


def verdict(causes: Iterable[tuple[str | None, int]]) -> Verdict:
    """The verdict of an episode from its calls' causes (cause, calls); None is clean."""
    counted: dict[str, int] = {}
    for cause, n in causes:
        if cause is not None:
            counted[cause] = counted.get(cause, 0) + n
    if not counted:
        return CLEAN_VERDICT
    return Verdict(INFRA, {c: counted[c] for c in CAUSES if c in counted})


def verdict_of_calls(calls: Iterable) -> Verdict:
    """The verdict of calls with ``status``, ``http_status`` and ``ids_missing``."""
    return verdict((cause_of(c.status, c.http_status, getattr(c, "ids_missing", None)), 1)
                   for c in calls)


# Calls that may show a cause: failed ones (ix_calls_failed) and those without ids.
_SUSPECT = or_(text(FAILED_SQL), Call.ids_missing.is_not(None))


async def verdicts(conn: AsyncConnection, engine: AsyncEngine,
                   episode_ids: list[str]) -> dict[str, Verdict]:
    """The verdict of each of these episodes (every id gets one: clean when none of its
    calls shows a cause); one grouped query."""
    out = dict.fromkeys(episode_ids, CLEAN_VERDICT)
    if not episode_ids:
        return out
    query = (select(Call.episode_id, Call.status, Call.http_status, Call.ids_missing,
                    func.count())
             .where(among(Call.episode_id, list(episode_ids), engine), _SUSPECT)
             .group_by(Call.episode_id, Call.status, Call.http_status, Call.ids_missing))
    found: dict[str, list[tuple[str | None, int]]] = {}
    for episode_id, status, http_status, ids_missing, n in await fetch(conn, query):
        found.setdefault(episode_id, []).append((cause_of(status, http_status, ids_missing),
                                                 int(n)))
    for episode_id, causes in found.items():
        out[episode_id] = verdict(causes)
    return out


async def verdicts_of(engine: AsyncEngine, episode_ids: list[str]) -> dict[str, Verdict]:
    """``verdicts`` on a connection of its own."""
    async with engine.connect() as conn:
        return await verdicts(conn, engine, episode_ids)
