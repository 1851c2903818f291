"""The viewer's aiohttp application: routes, the access gate, security headers, lifecycle.

Mounted by the proxy under ``/tracetap/ui`` (proxy/admin/ui.py) or served alone by
``tracetap ui``; either way every path is under PREFIX, so links and cookies are the same.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from urllib.parse import urlencode

import msgspec
from aiohttp import web
from sqlalchemy.exc import SQLAlchemyError

from tracetap.storage import blocks
from tracetap.storage.conversation import Readers
from tracetap.storage.scan import ScanError
from tracetap.storage.search_pool import SearchBounds
from tracetap.viewer import (
    PREFIX,
    access,
    compare,
    engineer,
    images,
    live,
    pages,
    search,
    variants,
)
from tracetap.viewer.access import Access, Verdict
from tracetap.viewer.annotate import post as post_annotation
from tracetap.viewer.detokenize import Detokenizer
from tracetap.viewer.headers import SECURITY_HEADERS
from tracetap.viewer.keys import (
    ACCESS,
    CLOSING,
    CONFIG,
    DETOKENIZER,
    READERS,
    ROWS,
    SOURCE,
    TEMPLATES,
)
from tracetap.viewer.params import BadParameter
from tracetap.viewer.render import Templates, page
from tracetap.viewer.rowcache import RowCache
from tracetap.viewer.source import Source

log = logging.getLogger("tracetap.viewer")
STATIC = Path(__file__).parent / "static"
OPEN_PATHS = (PREFIX + "/login", PREFIX + "/static/")  # before logging in


class ViewerConfig(msgspec.Struct, kw_only=True, frozen=True):
    database_url: str
    agent_url: str | None = None  # where agents reach the proxy (for the empty state)
    detokenize_url: str | None = None  # an engine base URL that answers /detokenize
    engine_api_key: str | None = None
    poll_interval: float = 0.25  # seconds between the live page's database reads
    data_dir: str | None = None  # where the dead-letter files are (storage.quarantine)
    search_index: bool = True  # False: the proxy indexes no text (--no-search-index)
    search: SearchBounds = msgspec.field(default_factory=SearchBounds)  # its own small pool


def build_viewer(config: ViewerConfig, gate: Access, readers: Readers, *,
                 mounted: bool = True) -> web.Application:
    """The viewer app. ``readers``: each wire API's conversation reader (the proxy's
    ``apis.registry.readers()``). ``mounted``: added under PREFIX by the proxy (routes
    relative to it); otherwise a whole server whose routes carry PREFIX themselves."""
    app = web.Application(middlewares=[_compressed, _headers, _errors, _gate])
    app[CONFIG] = config
    app[ACCESS] = gate
    app[TEMPLATES] = Templates()
    app[CLOSING] = asyncio.Event()
    app[ROWS] = RowCache()
    app[READERS] = readers
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_closing)
    base = "" if mounted else PREFIX
    r = app.router
    r.add_get(base + "/", pages.episodes)
    r.add_get(base + "/groups", pages.groups)
    r.add_get(base + "/search", search.page_handler)
    r.add_get(base + "/charts.svg", pages.charts_image)
    r.add_get(base + "/episodes/{episode}", pages.episode)
    r.add_get(base + "/calls/{call}", pages.call)
    r.add_get(base + "/calls/{call}/{body:request|response}.json", pages.call_body)
    r.add_get(base + "/images/{key:[0-9a-f]{32}}", images.serve)
    # Side-by-side comparison, harness variants, coverage heatmap
    r.add_get(base + "/compare", compare.episodes_page)
    r.add_get(base + "/compare/calls", compare.calls_page)
    r.add_get(base + "/variants", variants.variants_page)
    r.add_get(base + "/harnesses", variants.harnesses_page)
    r.add_get(base + "/engineer/{group}", engineer.round_page)
    r.add_post(base + "/annotations", post_annotation)
    r.add_get(base + "/live", live.page)
    r.add_get(base + "/live/events", live.events)
    r.add_get(base + "/login", pages.login_form)
    r.add_post(base + "/login", pages.login)
    r.add_post(base + "/logout", pages.logout)
    r.add_static(base + "/static", STATIC, append_version=False)
    if not mounted:
        r.add_get("/", _to_viewer)
        r.add_get(PREFIX, _to_viewer)
    return app


async def _to_viewer(request: web.Request) -> web.Response:
    raise web.HTTPFound(PREFIX + "/")


async def _lifecycle(app: web.Application):
    config = app[CONFIG]
    source = Source(config.database_url, config.search)
    detokenizer = Detokenizer(config.detokenize_url, config.engine_api_key)
    await detokenizer.start()
    # Warmed before the first request, not inside it: the templates compiled, and the
    # block codec (pyarrow, ~0.3 s to import) that reading a stored body or token array
    # needs; a fresh `tracetap ui` answered its first page in 0.4-1.4 s without this.
    app[TEMPLATES].warm()
    await asyncio.to_thread(blocks.codec)
    app[SOURCE] = source
    app[DETOKENIZER] = detokenizer
    try:
        yield
    finally:
        await detokenizer.close()
        await source.close()


# Only what the server renders is compressed: pages, chart images and JSON. Static files
# are small and cached; downloads are the stored bodies as they are; the live page's
# event stream is written as it happens. No page holds a secret an attacker's text could
# be compressed beside (the session cookie and the admin token are never in a body), so
# compression side channels (BREACH) have nothing to find.
_COMPRESSED = ("text/html", "image/svg+xml", "application/json")


@web.middleware
async def _compressed(request: web.Request, handler) -> web.StreamResponse:
    response = await handler(request)
    if (isinstance(response, web.Response) and not response.prepared
            and response.content_type in _COMPRESSED
            and not request.path.startswith(PREFIX + "/static/")):
        response.enable_compression()  # gzip or deflate, as Accept-Encoding asks
        response.headers["Vary"] = "Accept-Encoding"  # a cached chart image is one encoding
    return response


async def _closing(app: web.Application) -> None:
    app[CLOSING].set()  # live streams end, so shutdown does not wait for them


@web.middleware
async def _headers(request: web.Request, handler) -> web.StreamResponse:
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        exc.headers.update(SECURITY_HEADERS)
        raise
    if not response.prepared:  # live streams set theirs before they start
        response.headers.update(SECURITY_HEADERS)
        if not request.path.startswith(PREFIX + "/static/"):
            response.headers.setdefault("Cache-Control", "no-store")
    return response


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadParameter as exc:
        return page(request, "error.html", status=400, title="Bad request", message=str(exc))
    except ScanError as exc:
        log.warning("viewer: %s", exc)
        return page(request, "error.html", status=503, title="Database unavailable",
                    message=str(exc))
    except (SQLAlchemyError, OSError) as exc:
        log.warning("viewer: database read failed: %s", exc)
        return page(request, "error.html", status=503, title="Database unavailable",
                    message="The database could not be read; the proxy's log has the "
                            "details. Try again shortly.")


@web.middleware
async def _gate(request: web.Request, handler) -> web.StreamResponse:
    gate = request.app[ACCESS]
    if not gate.served_here(request):
        # The admin API has its own listener: the agent port does not serve the viewer.
        raise web.HTTPNotFound(text=f"{request.path} is not served on this port")
    if request.path.startswith(OPEN_PATHS):
        return await handler(request)
    found = access.verdict(request, gate.token(request))
    if found == Verdict.OK:
        return await handler(request)
    if found == Verdict.EPISODE_KEY:
        return page(request, "error.html", status=403, title="Forbidden",
                    message="Episode API keys are an agent's credential: they never open "
                            "the viewer. Use the proxy's admin token.")
    wants_page = request.method == "GET" and "text/html" in request.headers.get("Accept", "")
    if wants_page:
        raise web.HTTPSeeOther(f"{PREFIX}/login?{_next(request)}")
    raise web.HTTPUnauthorized(text="log in at " + PREFIX + "/login, or send the admin "
                               "token as Authorization: Bearer")


def _next(request: web.Request) -> str:
    return urlencode({"next": request.path_qs})
