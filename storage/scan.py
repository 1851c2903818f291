"""Bulk reads for export: episodes page by page, with their calls and choices decoded.

Memory is bounded by the page (a few hundred episodes and their calls), never by the
database. Pages are keyed by episode id, so each query is an index range, not an OFFSET.
Token arrays come back as the stored bytes (int32 / float64, native order; no Python
int per token): the exporter compares and concatenates them in C. SQLAlchemy writes the
SQL; rows come straight from the driver as tuples, which is 3x faster than SQLAlchemy's
result rows on the blob-heavy join.
"""

from __future__ import annotations

import contextlib
import operator
import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import msgspec
from sqlalchemy import event, func, null, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql import Select

from tracetap.storage.codec import SWAPPED as _SWAPPED
from tracetap.storage.codec import native_ids, native_logprobs
from tracetap.storage.engine import DatabaseURLError, async_url, create_engine, redact_url
from tracetap.storage.tables import Call, Choice, Episode


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


# gc=False: scanned structs hold data and never form cycles, so the cyclic collector
# need not track the hundreds of thousands an export creates.
class ScannedChoice(msgspec.Struct, kw_only=True, gc=False):
    index: int = 0
    finish_reason: str | None = None
    completion_ids: bytes | None = None  # int32, native byte order
    completion_logprobs: bytes | None = None  # float64, native byte order (as stored)
    token_source: str = "none"


class ScannedCall(msgspec.Struct, kw_only=True, gc=False):
    call_id: str
    episode_id: str | None = None
    seq: int = 0
    instance: str = ""
    endpoint: str = "chat.completions"
    model: str | None = None
    policy_version: str | None = None
    request: str | None = None  # None when the reader skips bodies
    response: str | None = None
    upstream_request: str | None = None  # the engine's view when it differs (with bodies)
    status: str = "ok"
    http_status: int = 200
    error: str | None = None
    t_start: float = 0.0
    t_end: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_ids: bytes | None = None  # int32, native byte order
    prompt_source: str | None = None
    ids_missing: str | None = None
    choices: list[ScannedChoice] = []


class ScannedEpisode(msgspec.Struct, kw_only=True, gc=False):
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


class ScanPage(msgspec.Struct):
    """Episodes in id order, and their calls as rows (see ROW) in arrival order."""

    episodes: list[ScannedEpisode]
    rows: list  # tuples (asyncpg Records on Postgres)


_EPISODE_COLUMNS = (Episode.id, Episode.group_id, Episode.task_id, Episode.harness_name,
                    Episode.harness_config, Episode.created_at, Episode.finished_at,
                    Episode.reward, Episode.rewards, Episode.outcome)
_ROW_COLUMNS = (Call.call_id, Call.episode_id, Call.seq, Call.instance, Call.endpoint,
                Call.model, Call.policy_version, Call.status, Call.http_status, Call.error,
                Call.t_start, Call.t_end, Call.prompt_tokens, Call.completion_tokens,
                Call.prompt_ids, Call.prompt_source, Call.ids_missing, Call.request,
                Call.response,
                Call.upstream_request, Call.overlay, Choice.choice_index,
                Choice.finish_reason, Choice.completion_ids, Choice.completion_logprobs,
                Choice.token_source)
# Bulk reads run on the driver connection, so its own errors come through unwrapped.
_READ_ERRORS = (SQLAlchemyError, OSError, sqlite3.Error, asyncpg.PostgresError,
                asyncpg.InterfaceError)
# A row: a call joined with one of its choices (choice columns null when it has none).
# Token columns are raw stored bytes; request/response are null unless read with bodies.
ROW = tuple(c.name for c in _ROW_COLUMNS)
_COL = {name: i for i, name in enumerate(ROW)}
_BODIES = (_COL["request"], _COL["response"], _COL["upstream_request"], _COL["overlay"])
_arrival = operator.itemgetter(_COL["episode_id"], _COL["t_start"], _COL["instance"],
                               _COL["seq"], _COL["choice_index"])


class Reader:
    """``async with Reader(url) as r``: counts and pages of episodes from one database.

    ``with_calls`` also gives each page's episodes their calls as ScannedCall structs
    (what the trajectory builder walks); rows alone serve the calls dataset.
    """

    def __init__(self, url: str, *, page_size: int = 256, with_bodies: bool = True,
                 with_calls: bool = True):
        self.url = url
        self.page_size = page_size
        self.with_bodies = with_bodies
        self.with_calls = with_calls
        self._engine: AsyncEngine | None = None

    async def __aenter__(self) -> Reader:
        with self._translated():
            target = async_url(self.url)
            if target.startswith("sqlite"):
                path = make_url(target).database
                if path and path != ":memory:" and not Path(path).exists():
                    raise ScanError(f"no database at {path}")
            self._engine = create_engine(self.url)
            if target.startswith("sqlite"):
                event.listen(self._engine.sync_engine, "connect", _bulk_read_cache)
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

    async def episodes(self, filt: EpisodeFilter) -> AsyncIterator[ScanPage]:
        """Pages of matching episodes in id order, with their calls in arrival order."""
        for_page = self._pages_by_ids if filt.episode_ids else self._pages_by_key
        async for rows in for_page(filt):
            page = [_episode(row) for row in rows
                    if filt.skip.get(row[0], -1.0) != row[6]]  # id, finished_at
            if page:
                with self._translated():
                    async with self.engine.connect() as conn:
                        calls = await self._rows(
                            conn, Call.episode_id.in_([e.id for e in page]))
                if self.with_calls:
                    by_id = {e.id: e for e in page}
                    for call in _calls(calls):
                        by_id[call.episode_id].calls.append(call)
                yield ScanPage(page, calls)

    async def bodies(self, call_ids: list[str]) -> dict[str, ScannedCall]:
        """Just the bodies of these calls (request, upstream_request, response)."""
        query = select(Call.call_id, Call.endpoint, Call.request, Call.upstream_request,
                       Call.response).where(Call.call_id.in_(call_ids))
        with self._translated():
            async with self.engine.connect() as conn:
                rows = await _fetch(conn, query)
        return {r[0]: ScannedCall(call_id=r[0], endpoint=r[1], request=r[2],
                                  upstream_request=r[3], response=r[4]) for r in rows}

    async def untagged_calls(self, filt: EpisodeFilter) -> AsyncIterator[ScanPage]:
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
                    keys = await _fetch(conn, query)
                    if not keys:
                        return
                    rows = await self._rows(conn, Call.call_id.in_([k[0] for k in keys]))
            after = (keys[-1][1], keys[-1][0])
            yield ScanPage([], rows)

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
                    rows = await _fetch(conn, query)
            if not rows:
                return
            last = rows[-1][0]
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
                    rows = await _fetch(conn, query)
            if rows:
                yield rows

    async def _rows(self, conn: AsyncConnection, condition) -> list:
        """Rows (ROW) of the calls matching ``condition``, in arrival order.

        No ORDER BY: SQLite would copy every token blob through a sort; the (small)
        keys are sorted here instead.
        """
        columns = list(_ROW_COLUMNS)
        if not self.with_bodies:
            for i in _BODIES:
                columns[i] = null().label(ROW[i])
        query = (select(*columns).outerjoin(Choice, Choice.call_id == Call.call_id)
                 .where(condition))
        rows = await _fetch(conn, query)
        if _SWAPPED:
            rows = [_native_row(row) for row in rows]
        rows.sort(key=_arrival)
        return rows

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
        except _READ_ERRORS as exc:
            detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
            hint = ""
            if "no such table" in detail or ("relation" in detail and "does not exist" in detail):
                hint = " (is the schema there? run `tracetap db upgrade --db URL`)"
            raise ScanError(f"cannot read {redact_url(self.url)}: {detail}{hint}") from exc


def _bulk_read_cache(dbapi_connection, _record) -> None:
    # 16 MiB of page cache instead of 2: the calls ⋈ choices pages read ~12% faster.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA cache_size=-16384")
    cursor.close()


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


async def _fetch(conn: AsyncConnection, query: Select) -> list:
    """``query``'s rows as tuples (asyncpg Records on Postgres), from the driver itself."""
    compiled = query.compile(dialect=conn.dialect, compile_kwargs={"render_postcompile": True})
    params = [compiled.params[name] for name in compiled.positiontup or ()]
    driver = (await conn.get_raw_connection()).driver_connection
    if conn.dialect.name == "postgresql":
        return await driver.fetch(str(compiled), *params)
    return list(await driver.execute_fetchall(str(compiled), params))


def _episode(row) -> ScannedEpisode:
    # Positional: the columns of _EPISODE_COLUMNS.
    (id_, group_id, task_id, harness_name, harness_config, created_at, finished_at,
     reward, rewards, outcome) = row
    return ScannedEpisode(
        id=id_, group_id=group_id, task_id=task_id, harness_name=harness_name,
        harness_config=harness_config, created_at=created_at, finished_at=finished_at,
        reward=reward, rewards=rewards, outcome=outcome, calls=[],
    )


def _calls(rows: list) -> list[ScannedCall]:
    """ScannedCall structs from rows in arrival order (a call's choices are adjacent)."""
    calls: list[ScannedCall] = []
    last_id = None
    for (call_id, episode_id, seq, instance, endpoint, model, policy_version, status,
         http_status, error, t_start, t_end, prompt_tokens, completion_tokens, prompt_ids,
         prompt_source, ids_missing, request, response, upstream_request, _overlay, index,
         finish, ids, logprobs, source) in rows:
        if call_id != last_id:
            last_id = call_id
            calls.append(ScannedCall(
                call_id=call_id, episode_id=episode_id, seq=seq, instance=instance,
                endpoint=endpoint, model=model, policy_version=policy_version,
                request=request, response=response, status=status, http_status=http_status,
                error=error, t_start=t_start, t_end=t_end, prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens, prompt_ids=prompt_ids,
                prompt_source=prompt_source, ids_missing=ids_missing,
                upstream_request=upstream_request, choices=[]))
        if index is not None:  # a call without choices (an error) has one null row
            calls[-1].choices.append(ScannedChoice(
                index=index, finish_reason=finish, completion_ids=ids,
                completion_logprobs=logprobs, token_source=source))
    return calls


_TOKENS = ((_COL["prompt_ids"], native_ids), (_COL["completion_ids"], native_ids),
           (_COL["completion_logprobs"], native_logprobs))


def _native_row(row) -> tuple:
    row = list(row)
    for i, convert in _TOKENS:
        row[i] = convert(row[i])
    return tuple(row)
