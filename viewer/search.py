"""The search page: episodes by what their calls said (storage.search), narrowed by the
episodes page's filters and by model, policy version, harness config factors and metadata.

``/tracetap/ui/search?q=FileNotFoundError&where=config.context=full,meta.batch=variants``.
The ``where`` terms are spelt as ``tracetap compare`` selectors spell them
(``config.NAME=VALUE``, ``meta.NAME=VALUE``; numbers, booleans and null as JSON).
It runs on the search's own engine, bounded in time, cancelled when its client leaves
(viewer.search_bounds); a refusal is a page that says why and what to do.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from urllib.parse import urlencode

import msgspec
from aiohttp import web

from tracetap.storage import browse, search
from tracetap.storage.conversation import Readers
from tracetap.storage.tables import Call, Episode
from tracetap.viewer import params
from tracetap.viewer.keys import CONFIG, READERS, SOURCE
from tracetap.viewer.render import page
from tracetap.viewer.search_bounds import Refused, bounded

COUNT_CAP = 1000  # matches counted exactly up to this many
FIELDS = ("q", "where", "model", "policy", "harness", "task", "outcome", "status",
          "finished", "sort", "order", "limit", "page")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_JSON_COLUMNS = {"config": Episode.harness_config, "meta": Episode.meta}


class Where(msgspec.Struct, frozen=True):
    model: str | None = None
    policy: str | None = None
    json: tuple[tuple[str, str, str], ...] = ()  # (config|meta, name, value)


def parse_where(query: Mapping[str, str]) -> Where:
    def text(name: str) -> str | None:
        value = query.get(name, "").strip()
        if len(value) > params.TEXT_LIMIT:
            raise params.BadParameter(f"{name} is longer than {params.TEXT_LIMIT} characters")
        return value or None

    terms = []
    for part in filter(None, (p.strip() for p in (text("where") or "").split(","))):
        key, sep, value = part.partition("=")
        scope, dot, name = key.strip().partition(".")
        if not sep or not dot or scope not in _JSON_COLUMNS or not _NAME.match(name) \
                or not value.strip():
            raise params.BadParameter(
                f"where: {part!r} is not config.NAME=VALUE or meta.NAME=VALUE (a harness "
                "config factor or a metadata key; several joined by commas)")
        terms.append((scope, name, value.strip()))
    return Where(model=text("model"), policy=text("policy"), json=tuple(terms))


def conditions(dialect: str, terms: search.Terms | None, where: Where,
               text: list | None = None) -> tuple:
    """The search's conditions; ``text``: the terms' own, resolved already."""
    out = list(text) if text is not None else [] if terms is None \
        else search.text_conditions(dialect, terms)
    if where.model is not None:
        out.append(search.call_condition(Call.model, where.model))
    if where.policy is not None:
        out.append(search.call_condition(Call.policy_version, where.policy))
    for scope, name, value in where.json:
        out.append(search.json_condition(dialect, _JSON_COLUMNS[scope], name, value))
    return tuple(out)


async def _search(engine, episodes: browse.EpisodeQuery, terms: search.Terms | None,
                  where: Where, readers: Readers) -> tuple[browse.EpisodePage, dict | None]:
    text_part = None if terms is None else await search.resolved_conditions(engine, terms)
    found = await browse.episode_page(
        engine, episodes, extra=conditions(engine.dialect.name, terms, where, text_part),
        count_cap=COUNT_CAP)
    snippets = None if terms is None else await search.snippets(
        engine, terms, [r.id for r in found.rows], readers)
    return found, snippets


def _link(query: Mapping[str, str], **changes) -> str:
    merged = {k: query.get(k, "") for k in FIELDS}
    merged.update({k: "" if v is None else str(v) for k, v in changes.items()})
    kept = {k: v for k, v in merged.items() if v}
    return "?" + urlencode(kept) if kept else "?"


def _filtered(query: Mapping[str, str], where: Where) -> bool:
    """Whether the page was asked for anything besides text."""
    return bool(where.model or where.policy or where.json) \
        or any(query.get(k) for k in ("harness", "task", "outcome", "status", "finished"))


async def page_handler(request: web.Request) -> web.Response:
    query = request.query
    text = query.get("q", "").strip()
    if len(text) > params.TEXT_LIMIT:
        raise params.BadParameter(f"q is longer than {params.TEXT_LIMIT} characters")
    # The episodes page's filters, but ``q`` here is the text, not part of an id; unless
    # no text is indexed (--no-search-index): then it is part of an id, as there.
    indexed = request.app[CONFIG].search_index
    episodes = params.episode_query({k: v for k, v in query.items() if k != "q" or not indexed})
    where = parse_where(query)
    try:
        terms = search.parse_terms(text) if text and indexed else None
    except search.TooManyWords as exc:
        raise params.BadParameter(f"q: {exc}") from None
    ignored = bool(text) and terms is None and indexed  # punctuation alone: nothing to find
    found = snippets = None
    if terms is not None or _filtered(query, where) or (bool(text) and not indexed):
        source = request.app[SOURCE]
        try:
            found, snippets = await bounded(
                request, _search(await source.search_engine(), episodes, terms, where,
                                 request.app[READERS]),
                source.search)
        except Refused as exc:
            return page(request, "error.html", status=exc.status, title=exc.title,
                        message=exc.message)
    return page(request, "search.html", view="search", found=found, snippets=snippets or {},
                text=text, ignored=ignored, indexed=indexed,
                filters={k: query.get(k, "") for k in FIELDS}, cap=COUNT_CAP,
                statuses=browse.STATUSES, sorts=list(browse.SORTS), sizes=params.PAGE_SIZES,
                link=lambda **changes: _link(query, **changes))
