"""The viewer's search on an engine of its own: few connections, every statement bounded.

A search is the one page a person can make arbitrarily expensive by what they type, so it
does not share a pool: the viewer's other pages (storage.scan.Reader) and the proxy's
writer keep theirs whatever searches run. Here:

- at most ``connections`` at once; a search that finds none free within ``wait`` seconds
  is refused (``sqlalchemy.exc.TimeoutError``: the viewer says the search is busy) rather
  than queued behind the others;
- on Postgres every statement runs under ``statement_timeout`` (``seconds``), so the
  database stops it itself, whatever happened to the client; a statement cancelled by
  the viewer (its client left) is cancelled in the database too (asyncpg sends the
  cancel request);
- on SQLite a progress handler interrupts a statement running past its connection's
  deadline (``seconds`` from the moment the connection was checked out): the same bound,
  as SQLite has no timeout of its own.
"""

from __future__ import annotations

import math
import time
from functools import partial

import msgspec
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util.concurrency import await_

from tracetap.storage.engine import create_engine, is_sqlite

_STEPS = 10_000  # SQLite VM instructions between two looks at the clock (~0.1 ms)


class SearchBounds(msgspec.Struct, kw_only=True, frozen=True):
    seconds: float = 1.5  # a statement's run (and the viewer's whole search) at most
    connections: int = 2
    wait: float = 0.5  # seconds a search waits for a free connection before it is refused


def search_engine(url: str, bounds: SearchBounds) -> AsyncEngine:
    pool = {"pool_size": bounds.connections, "max_overflow": 0, "pool_timeout": bounds.wait}
    if is_sqlite(url):
        engine = create_engine(url, **pool)
        event.listen(engine.sync_engine, "connect", _watch_clock)
        event.listen(engine.sync_engine, "checkout", partial(_arm, bounds.seconds))
        return engine
    timeout = str(max(1, round(bounds.seconds * 1000)))  # milliseconds
    return create_engine(url, connect_args={"server_settings": {"statement_timeout": timeout}},
                         **pool)


def _watch_clock(dbapi_connection, record) -> None:
    deadline = record.info["search_deadline"] = [math.inf]

    def past_deadline() -> int:  # non-zero: SQLite interrupts the statement
        return int(time.monotonic() > deadline[0])

    await_(dbapi_connection.driver_connection.set_progress_handler(past_deadline, _STEPS))


def _arm(seconds: float, _dbapi_connection, record, _proxy) -> None:
    # Never disarmed at checkin: a statement its search was cancelled from may still be
    # running in aiosqlite's thread, and it keeps this deadline until the next checkout.
    record.info["search_deadline"][0] = time.monotonic() + seconds

