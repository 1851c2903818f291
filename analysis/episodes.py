"""The episodes an analysis reads: one bulk read, JSON fields decoded once, factors as text.

Factors follow exporters.factors: the harness config's scalar values, as text.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import msgspec

from tracetap.analysis.runner.outcomes import INTERRUPTED
from tracetap.exporters.factors import factors_of
from tracetap.storage.annotations import labels_of
from tracetap.storage.integrity import CLEAN_VERDICT, INFRA, Verdict, verdicts
from tracetap.storage.scan import EpisodeFilter, Reader, ScanError
from tracetap.storage.summaries import EpisodeSummary, call_summaries, episode_summaries

T = TypeVar("T")


class AnalysisError(Exception):
    """An analysis could not run (bad input, empty selection); the message says why."""


class Episode(msgspec.Struct, kw_only=True, gc=False):
    summary: EpisodeSummary
    # config, metadata, factors: shared by the episodes with the same stored text; read only
    config: dict[str, Any]
    metadata: dict[str, Any]
    factors: dict[str, str]  # the config's scalar values as levels
    policies: frozenset[str] = frozenset()  # the calls' policy versions (when asked for)
    # People's labels on it (storage.annotations); None: not read (``read(labels=True)``).
    labels: frozenset[str] | None = None
    integrity: Verdict = CLEAN_VERDICT  # storage.integrity: clean, or infra and why

    @property
    def id(self) -> str:
        return self.summary.id

    @property
    def task(self) -> str | None:
        return self.summary.task_id


def load(
    db: str, filt: EpisodeFilter, *, policies: bool = False, costs: bool = False,
    labels: bool = True,
) -> list[Episode]:
    """The matching episodes in id order (blocking; runs its own event loop). ``costs``:
    with their calls' token and latency totals; ``policies``: their policy versions;
    ``labels``: the labels people gave them (one small read; every caller gets them unless
    it says not, so a ``label=`` selector works wherever selectors are taken)."""

    async def go() -> list[Episode]:
        async with open_reader(db) as reader:
            return await read(reader, filt, policies=policies, costs=costs, labels=labels)

    return run(go())


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, but the task does not hold the result: on Python 3.11,
    asyncio.run formats the finished task (result and all) while it restores the SIGINT
    handler, a third of a second for 4,000 packets."""
    result: list[T] = []

    async def keep() -> None:
        result.append(await main)

    asyncio.run(keep())
    return result[0]


@contextlib.asynccontextmanager
async def open_reader(db: str) -> AsyncIterator[Reader]:
    """A storage Reader whose errors (bad URL, no schema, driver errors) are AnalysisError."""
    try:
        async with Reader(db) as reader:
            yield reader
    except ScanError as exc:
        raise AnalysisError(str(exc)) from exc


async def read(
    reader: Reader, filt: EpisodeFilter, *, policies: bool = False, costs: bool = False,
    labels: bool = True,
) -> list[Episode]:
    summaries = await episode_summaries(reader, filt, costs=costs)
    labelled = await labels_of(reader.engine, [s.id for s in summaries]) if labels else {}
    with reader.translated():
        async with reader.engine.connect() as conn:
            verdict = await verdicts(conn, reader.engine, [s.id for s in summaries])
    versions: dict[str, set[str]] = {}
    if policies and summaries:
        for call in await call_summaries(reader, [s.id for s in summaries]):
            if call.policy_version is not None:
                versions.setdefault(call.episode_id, set()).add(call.policy_version)
    # Episodes of one harness variant share its config (and often their metadata): each
    # distinct text is decoded once, and episodes share the read-only result.
    configs: dict[str | None, tuple[dict[str, Any], dict[str, str]]] = {}
    metadata: dict[str | None, dict[str, Any]] = {}
    episodes = []
    for s in summaries:
        if (known := configs.get(s.harness_config)) is None:
            config = _object(s.harness_config)
            known = configs[s.harness_config] = (config, factors_of(config))
        if (meta := metadata.get(s.metadata)) is None:
            meta = metadata[s.metadata] = _object(s.metadata)
        episodes.append(
            Episode(
                summary=s,
                config=known[0],
                metadata=meta,
                factors=known[1],
                policies=frozenset(versions.get(s.id, ())),
                labels=frozenset(labelled.get(s.id, ())) if labels else None,
                integrity=_verdict(verdict[s.id], s.outcome),
            )
        )
    return episodes


def _verdict(of_calls: Verdict, outcome: str | None) -> Verdict:
    """The calls' verdict, and infra (cause ``interrupted``) for an attempt ``tracetap
    run`` was stopped in: its end was the run's, not the harness's."""
    if outcome != INTERRUPTED:
        return of_calls
    return Verdict(INFRA, {**of_calls.causes, INTERRUPTED: 1})


def _object(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    value = msgspec.json.decode(text)
    return value if isinstance(value, dict) else {}
