"""The live page: calls and episodes as the database receives them, over Server-Sent Events.

Each stream reads what was committed since its last read, every ``poll_interval``
seconds, from the database itself (not the proxy's memory), so it works the same under
``tracetap ui`` and across replicas. The writer stamps ``stored_at`` just before its
transaction commits, so each read looks OVERLAP_S back and drops what it already sent.
The event id is the read position: a reconnecting browser resumes where it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
from aiohttp import web

from tracetap.storage import changes
from tracetap.viewer.headers import SECURITY_HEADERS
from tracetap.viewer.keys import CLOSING, CONFIG, SOURCE
from tracetap.viewer.render import page as render_page

OVERLAP_S = 5.0
BATCH = 500
HEARTBEAT_S = 15.0
RECENT = 50


async def page(request: web.Request) -> web.Response:
    engine = await request.app[SOURCE].engine()
    since = time.time()
    calls = await changes.recent_calls(engine, RECENT)
    episodes = await changes.episodes_changed_since(engine, since - 3600, RECENT)
    episodes.sort(key=lambda e: max(e.created_at, e.finished_at or 0), reverse=True)
    return render_page(request, "live.html", calls=calls, episodes=episodes[:RECENT],
                       since=since, view="live")


async def events(request: web.Request) -> web.StreamResponse:
    engine = await request.app[SOURCE].engine()
    closing = request.app[CLOSING]
    interval = request.app[CONFIG].poll_interval
    since = _since(request)
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-store",
        "X-Accel-Buffering": "no"})
    response.headers.update(SECURITY_HEADERS)
    await response.prepare(request)
    await response.write(_event("hello", {"since": since}, since))
    sent_calls: dict[str, float] = {}
    sent_episodes: dict[tuple, float] = {}
    quiet = 0.0
    while not closing.is_set():
        cutoff = since - OVERLAP_S
        new_calls = [c for c in await changes.calls_stored_since(engine, cutoff, BATCH)
                     if c.call_id not in sent_calls]
        changed = [e for e in await changes.episodes_changed_since(engine, cutoff, BATCH)
                   if (e.id, e.finished_at) not in sent_episodes]
        chunks = []
        for e in changed:
            sent_episodes[(e.id, e.finished_at)] = max(e.created_at, e.finished_at or 0)
            chunks.append(_event("episode", e, None))
        for c in new_calls:
            sent_calls[c.call_id] = c.stored_at
            since = max(since, c.stored_at)
        for e in changed:
            since = max(since, e.created_at, e.finished_at or 0)
        chunks += [_event("call", c, since) for c in new_calls]
        quiet += interval
        if not chunks and quiet >= HEARTBEAT_S:
            chunks.append(b": keep-alive\n\n")
        if chunks:
            quiet = 0.0
            try:
                await response.write(b"".join(chunks))
            except ConnectionResetError:
                break
        _forget(sent_calls, since - OVERLAP_S)
        _forget(sent_episodes, since - OVERLAP_S)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(closing.wait(), interval)
    return response


def _since(request: web.Request) -> float:
    """Where to start: the browser's Last-Event-ID on a reconnect, else the page's time."""
    for value in (request.headers.get("Last-Event-ID"), request.query.get("since")):
        try:
            if value:
                return min(float(value), time.time())
        except ValueError:
            continue
    return time.time()


def _event(name: str, value, position: float | None) -> bytes:
    head = f"event: {name}\n"
    if position is not None:
        head += f"id: {position:.6f}\n"
    return head.encode() + b"data: " + msgspec.json.encode(value) + b"\n\n"


def _forget(sent: dict, before: float) -> None:
    for key in [k for k, t in sent.items() if t < before]:
        del sent[key]
