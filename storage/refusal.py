"""Writing a batch when the database may refuse some of its records.

A batch is one transaction, so one record the database refuses (a value it cannot hold)
fails all of them. ``write_batch`` tries the whole batch first (the only cost on the
happy path), and on a refusal splits it in halves until the refused record is alone:
every other record is written, the refused one is tried once more as ``storable`` makes
it, and if that is refused too it is handed back to be quarantined. An outage (the
connection, a lock, a missing table) is not a refusal: it raises, and the writer keeps
the batch journaled and retries it, as before.
"""

from __future__ import annotations

import sqlite3
import struct
from collections.abc import Awaitable, Callable

import msgspec
from asyncpg.exceptions import PostgresError
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.storage.records import CallRecord
from tracetap.storage.rows import insert_calls
from tracetap.storage.storable import storable

# SQLSTATE classes about the data itself: 22 data exception (a NUL, a string too long,
# a number out of range), 23 integrity constraint violation; 54000 a row over a limit.
_DATA_CLASSES = ("22", "23")
_DATA_STATES = ("54000",)
# What a value raises before or while the driver binds it: struct (token ids outside
# int32), sqlite3 (an int over int64: OverflowError; a lone surrogate: UnicodeEncodeError).
# None of them comes from a connection. (asyncpg's own bind errors, such as an int out of
# int4's range, carry SQLSTATE 22000.)
_VALUE_ERRORS = (ValueError, TypeError, OverflowError, struct.error,
                 sqlite3.IntegrityError, sqlite3.DataError, sqlite3.ProgrammingError)

Insert = Callable[[AsyncEngine, list[CallRecord]], Awaitable[None]]


def is_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is the database refusing the data (retrying cannot help), not an
    outage (retrying will, once it is back)."""
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return False
        exc = exc.orig if exc.orig is not None else exc
    if isinstance(exc, PostgresError):
        state = getattr(exc, "sqlstate", None) or ""
        return state[:2] in _DATA_CLASSES or state in _DATA_STATES
    return isinstance(exc, _VALUE_ERRORS)


def reason(exc: BaseException) -> str:
    """The refusal as one line: the error's type and message."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:1000]


class Refused(msgspec.Struct, frozen=True):
    record: CallRecord  # as captured (before ``storable``)
    reason: str


class Altered(msgspec.Struct, frozen=True):
    record: CallRecord  # as captured; the stored call is the altered copy
    notes: list[str]


class Outcome(msgspec.Struct):
    refused: list[Refused] = []
    altered: list[Altered] = []


async def write_batch(engine: AsyncEngine, records: list[CallRecord],
                      insert: Insert = insert_calls) -> Outcome:
    """Write ``records``; those the database refuses come back in the outcome. Raises
    what is not a refusal (the caller retries the batch: inserts are idempotent)."""
    outcome = Outcome()
    if records:
        await _write(engine, records, insert, outcome)
    return outcome


async def _write(engine: AsyncEngine, records: list[CallRecord], insert: Insert,
                 outcome: Outcome) -> None:
    try:
        await insert(engine, records)
        return
    except Exception as exc:
        if not is_refusal(exc):
            raise
        refusal = exc
    if len(records) > 1:
        middle = len(records) // 2
        await _write(engine, records[:middle], insert, outcome)
        await _write(engine, records[middle:], insert, outcome)
        return
    [record] = records
    fixed, notes = storable(record, engine.dialect.name)
    if notes:
        try:
            await insert(engine, [fixed])
            outcome.altered.append(Altered(record, notes))
            return
        except Exception as exc:
            if not is_refusal(exc):
                raise
            refusal = exc
    outcome.refused.append(Refused(record, reason(refusal)))
