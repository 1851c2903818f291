"""The reward trust verdict: whether an episode's outcome can be blamed on its harness.

An episode is ``clean`` unless one of its stored calls shows an infrastructure cause
(below); then it is ``infra``, with the causes and how many calls had each. A failure the
agent itself caused (a bad request, a stream it closed, a budget it spent) is the
policy's: it is counted under a cause of its own family (``agent_*``) and the episode
stays ``clean``, so a policy cannot escape a bad reward by failing on purpose (a trainer
that leaves ``infra`` episodes out would drop exactly those). The verdict is computed
from the stored calls whenever it is read (export, viewer, analysis, the finish metric),
never stored: it stays true after a crash, a replayed journal or a late call, and rows
stored before it existed get one too. docs/export.md's table gives every stored status
its cause and says why.

What never reaches the database as a call still leaves a row: a record dropped because
the journal was full, or refused by the database and kept in the dead-letter file, is
stored as a small *tombstone* call (status ``record_dropped`` / ``record_quarantined``,
``storage.tombstones``) of its episode, so the verdict sees it like any other call.

Infrastructure causes (the upstream, the proxy, storage, the operator), by a call's
status (``storage.records.STATUSES``) and HTTP status:

==================== =====================================================================
upstream_error       the upstream failed, was unreachable, broke mid-reply, or answered
                     500 or more, or 429
upstream_timeout     the upstream did not answer in time
paused               held at a weight-sync pause past its timeout (the operator's)
overlay_failed       an overlay hook failed under --overlay-fail closed (the operator's)
proxy_error          the proxy failed on the request itself (500 internal_error), could
                     not serve it (a refusal of 500 or more: the database it needs down),
                     or was stopped under it
no_token_ids         stored without usable token ids (``ids_missing``)
record_dropped       its record was lost: the journal was full (a tombstone)
record_quarantined   its record was refused by the database (a tombstone; the record is
                     in the dead-letter file)
deadline_exceeded    ran past --call-deadline waiting on the upstream (or a pause)
record_lost          its replica was admitting it when it died, or was declared lost
                     (a tombstone, storage.intents)
==================== =====================================================================

The agent's own (``AGENT_CAUSES``; the episode stays clean):

========================= ================================================================
agent_bad_request         the proxy refused its request (4xx: body too large or too slow,
                          not JSON, untranslatable, a model not its episode's), or the
                          upstream answered 4xx (not 429: "context too long")
agent_disconnect          it went away mid-reply (closed its stream early)
agent_budget              its episode's calls / tokens / seconds budget refused the call
agent_stalled             it did not read its stream: the call was ended at the deadline
agent_unsupported_request stored without ids because the request is one tracetap cannot
                          tokenize (a batch of prompts)
========================= ================================================================

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
INFRA_CAUSES = ("upstream_error", "upstream_timeout", "paused", "overlay_failed",
                "proxy_error", "no_token_ids", "record_dropped", "record_quarantined",
                "deadline_exceeded", "record_lost")
AGENT_CAUSES = ("agent_bad_request", "agent_disconnect", "agent_budget",
                "agent_unsupported_request", "agent_stalled")
CAUSES = INFRA_CAUSES + AGENT_CAUSES

_BY_STATUS = {
    "upstream_error": "upstream_error",
    "upstream_unreachable": "upstream_error",
    "upstream_timeout": "upstream_timeout",
    "paused": "paused",
    "budget_exceeded": "agent_budget",
    "overlay_failed": "overlay_failed",
    "error": "proxy_error",
    "proxy_stopped": "proxy_error",
    "client_disconnected": "agent_disconnect",
    "record_dropped": "record_dropped",
    "record_quarantined": "record_quarantined",
    "deadline_exceeded": "deadline_exceeded",
    "client_stalled": "agent_stalled",
    "record_lost": "record_lost",
}
# Statuses whose HTTP status is the upstream's own answer.
_ANSWERED = ("ok", "passthrough", "vetoed")
# Why ids can be missing that the agent's request decides (proxy.tokens.resolve).
_AGENT_IDS_MISSING = {"unsupported_request": "agent_unsupported_request"}


class Verdict(msgspec.Struct, frozen=True, gc=False):
    """``integrity``: clean or infra; ``causes``: {cause: calls}, in CAUSES' order: the
    infrastructure's (any makes it infra) then the agent's (never do)."""

    integrity: str = CLEAN
    causes: dict[str, int] = {}

    @property
    def infra(self) -> bool:
        return self.integrity == INFRA

    def describe(self) -> str:
        """``clean``, ``infra: upstream_error (2), no_token_ids (1)`` or
        ``clean: agent_disconnect (1)``."""
        if not self.causes:
            return self.integrity
        return f"{self.integrity}: " + ", ".join(f"{c} ({n})" for c, n in self.causes.items())


CLEAN_VERDICT = Verdict()


def cause_of(status: str, http_status: int, ids_missing: str | None = None) -> str | None:
    """The cause a stored call shows (INFRA_CAUSES or AGENT_CAUSES), or None."""
    if status in _ANSWERED:
        if http_status >= 500 or http_status == 429:
            return "upstream_error"
        if 400 <= http_status < 500:
            return "agent_bad_request"  # the upstream refused what the agent sent
        if status == "ok" and ids_missing:
            return _AGENT_IDS_MISSING.get(ids_missing, "no_token_ids")
        return None
    if status == "bad_request":  # the proxy's refusal: the agent's input, unless it is 5xx
        return "proxy_error" if http_status >= 500 else "agent_bad_request"
    return _BY_STATUS.get(status)


def verdict(causes: Iterable[tuple[str | None, int]]) -> Verdict:
    """The verdict of an episode from its calls' causes (cause, calls); None is no cause.
    Infra only when an infrastructure cause is among them."""
    counted: dict[str, int] = {}
    for cause, n in causes:
        if cause is not None:
            counted[cause] = counted.get(cause, 0) + n
    if not counted:
        return CLEAN_VERDICT
    integrity = INFRA if any(c in counted for c in INFRA_CAUSES) else CLEAN
    return Verdict(integrity, {c: counted[c] for c in CAUSES if c in counted})


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
