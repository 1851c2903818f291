"""A search runs under three bounds, and each refusal is a page that says what to do.

- Time: the whole search (all of its statements) within the pool's ``seconds`` and a
  margin; past it, the search is cancelled (its statement in the database too). Each
  statement is bounded in the database as well (storage.search_pool): Postgres's
  statement_timeout, SQLite's progress handler.
- The client: a person who closes the tab or presses stop leaves nobody to answer, so the
  search is cancelled as soon as its connection is seen closed (looked at every POLL
  seconds: aiohttp does not cancel a handler when its client goes).
- The pool: a search that finds no free connection in the search pool is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import TypeVar

from aiohttp import web
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from tracetap.storage.search_pool import SearchBounds

T = TypeVar("T")
POLL = 0.1  # seconds between two looks at the client's connection
MARGIN = 0.5  # seconds past the statement bound before the viewer stops waiting
CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never seen by anyone
log = logging.getLogger("tracetap.viewer")


class Refused(Exception):
    def __init__(self, status: int, title: str, message: str):
        super().__init__(message)
        self.status, self.title, self.message = status, title, message


def _too_slow(bounds: SearchBounds) -> Refused:
    return Refused(422, "Search stopped", (
        f"This search took longer than {bounds.seconds:g} s and was stopped. Add a rarer "
        "word (an error's name, a path, an id) or a filter (harness, task, model, "
        "config.NAME=VALUE), or drop the most common words."))


def _statement_stopped(exc: DBAPIError) -> bool:
    """Whether the database stopped the statement for its bound (not any other error)."""
    orig = exc.orig
    return getattr(orig, "sqlstate", None) == "57014" or "interrupted" in str(orig) \
        or "statement timeout" in str(orig)


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def bounded(request: web.Request, work: Awaitable[T], bounds: SearchBounds) -> T:
    """``work``'s result, or Refused; cancelled (CLIENT_CLOSED) when the client left."""
    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bounds.seconds + MARGIN
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=POLL)
            if task.done():
                break
            if _gone(request):
                log.info("viewer: search cancelled, its client left: %s", request.path_qs)
                raise Refused(CLIENT_CLOSED, "Search cancelled", "Its client left.")
            if loop.time() > deadline:
                raise _too_slow(bounds)
        return task.result()
    except PoolTimeout:
        raise Refused(503, "Search busy", (
            f"{bounds.connections} searches are running, the most at once; this one "
            "waited and was not started. Try again in a moment.")) from None
    except DBAPIError as exc:
        if _statement_stopped(exc):
            raise _too_slow(bounds) from None
        raise
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
