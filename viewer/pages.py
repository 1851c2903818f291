"""The viewer's pages: episodes (and groups), one episode, one call, login."""

from __future__ import annotations

import re

from aiohttp import web

from tracetap.storage import browse, details, quarantine
from tracetap.storage.integrity import verdicts_of
from tracetap.viewer import PREFIX, access, charts, conversation, jsonview, lowp, params, tokens
from tracetap.viewer.annotate import call_notes, episode_notes
from tracetap.viewer.callinfo import error_line
from tracetap.viewer.collapse import collapsed
from tracetap.viewer.keys import ACCESS, CONFIG, DETOKENIZER, READERS, ROWS, SOURCE
from tracetap.viewer.render import page
from tracetap.viewer.tokenhtml import pieces_html, script_json
from tracetap.viewer.tree import call_lineage, episode_tree

EPISODE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
CALL_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
CHART_EPISODES = 2000  # the charts describe the most recent matching episodes


def _engine(request: web.Request):
    return request.app[SOURCE].engine()


def _empty_hint(request: web.Request) -> str:
    agent_url = request.app[CONFIG].agent_url or "http://<proxy>"
    return f"{agent_url}/episodes/<episode-id>/v1"


async def episodes(request: web.Request) -> web.Response:
    query = params.episode_query(request.query)
    engine = await _engine(request)
    found = await browse.episode_page(engine, query)
    group = (await browse.group_rewards(engine, query.group_id)
             if query.group_id is not None else None)
    data_dir = request.app[CONFIG].data_dir
    integrity = await verdicts_of(engine, [e.id for e in found.rows])  # storage.integrity
    return page(request, "episodes.html", found=found, group=group, view="episodes",
                integrity=integrity,
                quarantined=quarantine.count(data_dir) if data_dir else (0, 0),
                data_dir=data_dir, **_listing(request))


async def groups(request: web.Request) -> web.Response:
    query = params.episode_query(request.query)
    found = await browse.group_page(await _engine(request), query)
    return page(request, "groups.html", found=found, view="groups", **_listing(request))


def _listing(request: web.Request) -> dict:
    """What the episodes and groups pages share: the filter form and its links."""
    filters = params.filters(request.query)
    return {"filters": filters, "filtered": any(filters[k] for k in params.FILTERS),
            "link": lambda **changes: params.link(request.query, **changes),
            "hint": _empty_hint(request), "sizes": params.PAGE_SIZES,
            "sorts": list(browse.SORTS), "statuses": browse.STATUSES}


async def charts_image(request: web.Request) -> web.Response:
    query = params.episode_query(request.query)
    sample = await browse.chart_sample(await _engine(request), query, CHART_EPISODES)
    panels = [
        charts.histogram(charts.left_out("reward", sample.episodes - len(sample.rewards),
                                         "without a reward"), sample.rewards),
        charts.histogram("calls per episode", sample.calls_per_episode, integers=True),
        charts.histogram("trajectory tokens per episode", sample.tokens_per_episode),
        charts.percentiles_over_time("call latency", sample.latencies),
    ]
    response = page(request, "charts.svg", content_type="image/svg+xml", panels=panels,
                    episodes=sample.episodes, limit=CHART_EPISODES)
    # Back and forward (and the same filters reloaded) reuse it for a minute.
    response.headers["Cache-Control"] = "private, max-age=60"
    return response


async def episode(request: web.Request) -> web.Response:
    episode_id = request.match_info["episode"]
    if not EPISODE_ID.match(episode_id):
        raise web.HTTPNotFound(text="not an episode id")
    engine = await _engine(request)
    info = await details.episode_info(engine, episode_id)
    if info is None:
        return page(request, "error.html", status=404, title="No such episode",
                    message=f"No episode {episode_id!r} in this database.")
    rows = await request.app[ROWS].rows(await request.app[SOURCE].reader(), episode_id)
    index = _bounded(request, "t", 0, 0, max(len(rows) - 1, 0))
    size = _bounded(request, "n", tokens.WINDOW, 64, tokens.MAX_WINDOW)
    row = rows[index] if rows else None
    window = overview = texts = low = None
    if row is not None:
        at = _bounded(request, "at", 0, 0, max(row.total - 1, 0))
        shown = row.ids[at:at + size]
        split = row.split
        # The row's low-probability tokens (their texts are asked for too)
        low = lowp.summary(row, at, at + size, *lowp.options(request.query))
        texts = await request.app[DETOKENIZER].texts(
            [*shown, *(split.expected if split else ()), *(split.received if split else ()),
             *lowp.token_ids(low)])
        overlapping = [s.call_id for s in row.spans if s.end > at and s.start < at + size]
        alternatives = await details.top_logprobs(engine, overlapping)
        window = tokens.window(row, at, size, texts, alternatives)
        overview = tokens.overview(row, size, at)
    leaf = row.trajectory.call_ids[-1] if row is not None else (
        info.calls[-1].call_id if info.calls else None)
    turns = []
    if leaf is not None:
        bodies = await details.call_bodies(engine, [leaf])
        if leaf in bodies:
            turns = conversation.turns(request.app[READERS], *bodies[leaf])
    group = (await browse.group_rewards(engine, info.group_id)
             if info.group_id is not None else None)
    return page(request, "episode.html", info=info, rows=rows, row=row, window=window,
                overview=overview, texts=texts or {}, turns=turns, leaf=leaf, group=group,
                timeline=charts.timeline(info.calls), size=size,
                listed=collapsed(info.calls, request.query.get("calls") == "all"),
                token_html=pieces_html(window.pieces) if window else "",
                token_json=script_json(window.data) if window else "",
                budget_exceeded=any(c.status == "budget_exceeded" for c in info.calls),
                integrity=(await verdicts_of(engine, [episode_id]))[episode_id],
                harness_config=_pretty(info.harness_config), info_json=_pretty(info.info),
                metadata_json=_pretty(info.metadata), rewards_json=info.rewards,
                low=low, low_href=lowp.linker(request.query, size),
                tree=await episode_tree(engine, request.app[READERS], episode_id),
                **await episode_notes(request, episode_id))


def _pretty(value) -> str | None:
    return None if value is None else conversation.pretty(value)


def _bounded(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    value = request.query.get(name, "")
    try:
        number = int(value) if value else default
    except ValueError:
        raise params.BadParameter(f"{name} must be an integer") from None
    return max(low, min(number, high))


async def call(request: web.Request) -> web.Response:
    call_id = request.match_info["call"]
    if not CALL_ID.match(call_id):
        raise web.HTTPNotFound(text="not a call id")
    stored = await details.stored_call(await _engine(request), call_id)
    if stored is None:
        return page(request, "error.html", status=404, title="No such call",
                    message=f"No call {call_id!r} in this database.")
    request_json = jsonview.parse(stored.request)
    response_json = jsonview.parse(stored.response)
    return page(
        request, "call.html", stored=stored, s=stored.summary,
        turns=conversation.turns(request.app[READERS], stored.summary.endpoint, stored.request,
                                 stored.response),
        request_tree=None if request_json is None else jsonview.tree(request_json),
        response_tree=None if response_json is None else jsonview.tree(response_json),
        error=error_line(stored.summary, stored.response),
        request_text=stored.request if request_json is None else None,
        response_text=stored.response if response_json is None else None,
        limit=jsonview.STRING_LIMIT, **await call_notes(request, call_id),
        lineage=await call_lineage(await _engine(request), request.app[READERS],
                                   stored.episode_id, call_id))


async def call_body(request: web.Request) -> web.Response:
    """The stored body as it is, as a download (never rendered by the browser)."""
    call_id, which = request.match_info["call"], request.match_info["body"]
    if not CALL_ID.match(call_id):
        raise web.HTTPNotFound(text="not a call id")
    stored = await details.stored_call(await _engine(request), call_id)
    if stored is None:
        raise web.HTTPNotFound(text="no such call")
    body = stored.request if which == "request" else stored.response
    return web.Response(text=body or "", content_type="application/octet-stream", headers={
        "Content-Disposition": f'attachment; filename="{call_id}-{which}.json"'})


async def login_form(request: web.Request) -> web.Response:
    return page(request, "login.html", next=access.safe_next(request.query.get("next"), PREFIX),
                error=None)


async def login(request: web.Request) -> web.Response:
    if not access.same_origin(request):
        raise web.HTTPForbidden(text="cross-site login refused")
    form = await request.post()
    given = str(form.get("token", "")).strip()
    target = access.safe_next(str(form.get("next", "")), PREFIX)
    gate = request.app[ACCESS]
    error = None
    if given.startswith(access.EPISODE_KEY_PREFIX):
        error = ("That is an episode API key (an agent's credential): it never opens the "
                 "viewer. Use the proxy's admin token.")
    elif not given or not access.token_matches(gate.token(request), given):
        error = ("Not the admin token. It is the proxy's --admin-token, or the file "
                 "DATA_DIR/admin-token (print it with: tracetap admin-token).")
    if error is not None:
        return page(request, "login.html", status=401, next=target, error=error)
    response = web.HTTPSeeOther(target)
    access.set_session(response, request, gate.token(request), PREFIX)
    raise response


async def logout(request: web.Request) -> web.Response:
    if not access.same_origin(request):
        raise web.HTTPForbidden(text="cross-site logout refused")
    response = web.HTTPSeeOther(PREFIX + "/login")
    access.clear_session(response, PREFIX)
    raise response
