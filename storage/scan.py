"""Bulk reads for export: episodes page by page, with their calls and choices decoded.

Memory is bounded by the page (a few hundred episodes and their calls), never by the
database. Pages are keyed by episode id, so each query is an index range, not an OFFSET.
Token arrays come back as typed ``memoryview``s over the stored bytes (no copy, no
Python int per token): the exporter slices, compares and concatenates them in C.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import msgspec
from sqlalchemy import func, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from storage.codec import ids_view, logprobs_view
from storage.engine import DatabaseURLError, async_url, create_engine, redact_url
from storage.tables import Call, Choice, Episode


class ScanError(Exception):
    """The database could not be read: bad URL, unreachable, or not migrated."""


class EpisodeFilter(msgspec.Struct, kw_only=True):
    """Which episodes to read. Times are epoch seconds."""

    since: float | None = None  # created_at >= since
    until: float | None = None  # created_at < until
    episode_ids: tuple[str, ...] = ()  # empty: all
    group_id: str | None = None
    finished_only: bool = True
    finished_from: float | None = None  # incremental watermark: finished_at >= this
    # Episodes already exported at exactly this finished_at (the watermark's overlap).
    skip: dict[str, float] = {}


class ScannedChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    finish_reason: str | None = None
    completion_ids: Sequence[int] | None = None  # int32 view
    completion_logprobs: Sequence[float] | None = None  # float64 view, as stored
    token_source: str = "none"


class ScannedCall(msgspec.Struct, kw_only=True):
    call_id: str
    episode_id: str | None = None
    seq: int = 0
    instance: str = ""
    endpoint: str = "chat.completions"
    model: str | None = None
    policy_version: str | None = None
    request: str | None = None  # None when the reader skips bodies
    response: str | None = None
    status: str = "ok"
    http_status: int = 200
    error: str | None = None
    t_start: float = 0.0
    t_end: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_ids: Sequence[int] | None = None  # int32 view
    choices: list[ScannedChoice] = []


class ScannedEpisode(msgspec.Struct, kw_only=True):
    id: str
    group_id: str | None = None
    task_id: str | None = None
    harness_name: str | None = None
    harness_config: str | None = None  # JSON text, as stored
    created_at: float = 0.0
    finished_at: float | None = None
    reward: float | None = None
    rewards: str | None = None  # JSON text
    outcome: str | None = None
    calls: list[ScannedCall] = []


_EPISODE_COLUMNS = (Episode.id, Episode.group_id, Episode.task_id, Episode.harness_name,
                    Episode.harness_config, Episode.created_at, Episode.finished_at,
                    Episode.reward, Episode.rewards, Episode.outcome)
_CALL_COLUMNS = (Call.call_id, Call.episode_id, Call.seq, Call.instance, Call.endpoint,
                 Call.model, Call.policy_version, Call.status, Call.http_status, Call.error,
                 Call.t_start, Call.t_end, Call.prompt_tokens, Call.completion_tokens,
                 Call.prompt_ids)
_CHOICE_COLUMNS = (Choice.call_id, Choice.choice_index, Choice.finish_reason,
                   Choice.completion_ids, Choice.completion_logprobs, Choice.token_source)


class Reader:
    """``async with Reader(url) as r``: counts and pages of episodes from one database."""

    def __init__(self, url: str, *, page_size: int = 256, with_bodies: bool = True):
        self.url = url
        self.page_size = page_size
        self.with_bodies = with_bodies
        self._engine: AsyncEngine | None = None

    async def __aenter__(self) -> Reader:
        with self._translated():
            target = async_url(self.url)
            if target.startswith("sqlite"):
                path = make_url(target).database
                if path and path != ":memory:" and not Path(path).exists():
                    raise ScanError(f"no database at {path}")
            self._engine = create_engine(self.url)
        try:
            await self._check_schema()
        except BaseException:
            await self.__aexit__()  # __aexit__ is not called when __aenter__ raises
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._engine is not None:
            await self._engine.dispose()
            self._engine = None

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            raise RuntimeError("Reader used outside `async with`")
        return self._engine

    async def count(self, filt: EpisodeFilter) -> int:
        """Episodes matching ``filt`` (for progress; ``skip`` is not subtracted)."""
        query = select(func.count()).select_from(Episode).where(*_conditions(filt))
        ids = sorted(set(filt.episode_ids))
        chunks = [ids[i:i + self.page_size] for i in range(0, len(ids), self.page_size)]
        total = 0
        with self._translated():
            async with self.engine.connect() as conn:
                for chunk in chunks or [None]:
                    counted = query if chunk is None else query.where(Episode.id.in_(chunk))
                    total += int((await conn.execute(counted)).scalar() or 0)
        return total

    async def episodes(self, filt: EpisodeFilter) -> AsyncIterator[list[ScannedEpisode]]:
        """Pages of matching episodes in id order, each with its calls in arrival order."""
        for_page = self._pages_by_ids if filt.episode_ids else self._pages_by_key
        async for rows in for_page(filt):
            page = [_episode(row) for row in rows
                    if filt.skip.get(row.id, -1.0) != row.finished_at]
            if page:
                await self._attach_calls(page)
                yield page

    async def untagged_calls(self, filt: EpisodeFilter) -> AsyncIterator[list[ScannedCall]]:
        """Calls that carried no episode, by t_start (``since``/``until`` apply to it)."""
        after: tuple[float, str] | None = None
        while True:
            query = select(Call.call_id, Call.t_start).where(Call.episode_id.is_(None))
            if filt.since is not None:
                query = query.where(Call.t_start >= filt.since)
            if filt.until is not None:
                query = query.where(Call.t_start < filt.until)
            if after is not None:
                query = query.where((Call.t_start > after[0])
                                    | ((Call.t_start == after[0]) & (Call.call_id > after[1])))
            query = query.order_by(Call.t_start, Call.call_id).limit(self.page_size * 2)
            with self._translated():
                async with self.engine.connect() as conn:
                    rows = (await conn.execute(query)).all()
                    if not rows:
                        return
                    calls = await self._with_choices(conn, Call.call_id.in_(
                        [row.call_id for row in rows]))
            after = (rows[-1].t_start, rows[-1].call_id)
            yield sorted(calls, key=_arrival)

    # -- internals -------------------------------------------------------------------

    async def _pages_by_key(self, filt: EpisodeFilter) -> AsyncIterator[list]:
        last: str | None = None
        while True:
            query = select(*_EPISODE_COLUMNS).where(*_conditions(filt))
            if last is not None:
                query = query.where(Episode.id > last)
            query = query.order_by(Episode.id).limit(self.page_size)
            with self._translated():
                async with self.engine.connect() as conn:
                    rows = (await conn.execute(query)).all()
            if not rows:
                return
            last = rows[-1].id
            yield rows

    async def _pages_by_ids(self, filt: EpisodeFilter) -> AsyncIterator[list]:
        # Explicit ids are paged in Python so the IN list stays small on every backend.
        ids = sorted(set(filt.episode_ids))
        for start in range(0, len(ids), self.page_size):
            chunk = ids[start:start + self.page_size]
            query = (select(*_EPISODE_COLUMNS).where(*_conditions(filt), Episode.id.in_(chunk))
                     .order_by(Episode.id))
            with self._translated():
                async with self.engine.connect() as conn:
                    rows = (await conn.execute(query)).all()
            if rows:
                yield rows

    def _call_columns(self) -> tuple:
        if self.with_bodies:
            return (*_CALL_COLUMNS, Call.request, Call.response)
        return _CALL_COLUMNS

    async def _attach_calls(self, page: list[ScannedEpisode]) -> None:
        by_id = {e.id: e for e in page}
        with self._translated():
            async with self.engine.connect() as conn:
                calls = await self._with_choices(conn, Call.episode_id.in_(list(by_id)))
        calls.sort(key=_arrival)
        for call in calls:
            by_id[call.episode_id].calls.append(call)

    async def _with_choices(self, conn, condition) -> list[ScannedCall]:
        """Calls matching ``condition`` with their choices: one query, a row per choice.

        No ORDER BY: SQLite would copy every token blob through a sort; the caller
        sorts the (small) keys instead.
        """
        columns = self._call_columns()
        query = (select(*columns, *_CHOICE_COLUMNS[1:])
                 .outerjoin(Choice, Choice.call_id == Call.call_id).where(condition))
        calls: dict[str, ScannedCall] = {}
        split = len(columns)
        for row in (await conn.execute(query)).all():
            call = calls.get(row[0])
            if call is None:
                call = calls[row[0]] = _call(row[:split])
            index, finish, ids, logprobs, source = row[split:]
            if index is not None:  # a call without choices (an error) has one null row
                call.choices.append(ScannedChoice(
                    index=index, finish_reason=finish, completion_ids=ids_view(ids),
                    completion_logprobs=logprobs_view(logprobs), token_source=source))
        for call in calls.values():
            if len(call.choices) > 1:
                call.choices.sort(key=_choice_index)
        return list(calls.values())

    async def _check_schema(self) -> None:
        with self._translated():
            async with self.engine.connect() as conn:
                await conn.execute(select(Episode.id).limit(1))
                await conn.execute(select(Choice.call_id).limit(1))

    @contextlib.contextmanager
    def _translated(self) -> Iterator[None]:
        """SQLAlchemy and driver errors become one ScanError with the URL (password masked)."""
        try:
            yield
        except ScanError:
            raise
        except DatabaseURLError as exc:
            raise ScanError(str(exc)) from exc
        except (SQLAlchemyError, OSError) as exc:
            detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
            hint = ""
            if "no such table" in detail or ("relation" in detail and "does not exist" in detail):
                hint = " (is the schema there? run `tracetap db upgrade --db URL`)"
            raise ScanError(f"cannot read {redact_url(self.url)}: {detail}{hint}") from exc


def _conditions(filt: EpisodeFilter) -> list:
    conditions = []
    if filt.finished_only or filt.finished_from is not None:
        conditions.append(Episode.finished_at.is_not(None))
    if filt.finished_from is not None:
        conditions.append(Episode.finished_at >= filt.finished_from)
    if filt.group_id is not None:
        conditions.append(Episode.group_id == filt.group_id)
    if filt.since is not None:
        conditions.append(Episode.created_at >= filt.since)
    if filt.until is not None:
        conditions.append(Episode.created_at < filt.until)
    return conditions


def _episode(row) -> ScannedEpisode:
    return ScannedEpisode(
        id=row.id, group_id=row.group_id, task_id=row.task_id, harness_name=row.harness_name,
        harness_config=row.harness_config, created_at=row.created_at,
        finished_at=row.finished_at, reward=row.reward, rewards=row.rewards,
        outcome=row.outcome, calls=[],
    )


def _call(row) -> ScannedCall:
    # Positional: the columns of _CALL_COLUMNS, then request and response when selected.
    (call_id, episode_id, seq, instance, endpoint, model, policy_version, status,
     http_status, error, t_start, t_end, prompt_tokens, completion_tokens, prompt_ids,
     *bodies) = row
    request, response = bodies if bodies else (None, None)
    return ScannedCall(
        call_id=call_id, episode_id=episode_id, seq=seq, instance=instance,
        endpoint=endpoint, model=model, policy_version=policy_version, request=request,
        response=response, status=status, http_status=http_status, error=error,
        t_start=t_start, t_end=t_end, prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens, prompt_ids=ids_view(prompt_ids), choices=[],
    )


def _arrival(call: ScannedCall) -> tuple:
    # Arrival order within an episode (DESIGN: t_start, then the replica, then its seq).
    return (call.episode_id or "", call.t_start, call.instance, call.seq)


def _choice_index(choice: ScannedChoice) -> int:
    return choice.index
