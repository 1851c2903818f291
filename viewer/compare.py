"""Two episodes, two trajectory rows or two calls side by side: where their tokens part.

Each side is a token sequence (a row exactly as exported, or a call's prompt and its
first choice's completion) and the conversation of its last call. The first diverging
token is found the way the "why this row split" box finds it (tokens._common over the
int32 arrays); the token windows around it are drawn side by side with it marked, and
the two conversations are aligned message by message with the first difference marked.
"""

from __future__ import annotations

from array import array
from itertools import zip_longest
from urllib.parse import urlencode

import msgspec
from aiohttp import web

from tracetap.storage import details
from tracetap.storage.scan import ScannedCall
from tracetap.viewer import PREFIX, conversation, tokenmask
from tracetap.viewer.conversation import Turn
from tracetap.viewer.keys import DETOKENIZER, READERS, ROWS, SOURCE
from tracetap.viewer.pages import CALL_ID, EPISODE_ID
from tracetap.viewer.params import BadParameter
from tracetap.viewer.render import page
from tracetap.viewer.tokens import SHOWN_DIVERGING, _band, _common, episode_rows

BEFORE = 160  # shared tokens shown before the divergence
AFTER = 352  # tokens shown from it on
DASH = "\u2013"
_KINDS = bytes.maketrans(b"\x00\x01", b"os")


class Side(msgspec.Struct, kw_only=True):
    name: str  # "A" or "B"
    title: str  # what it is, for the heading
    href: str  # its page
    episode_id: str | None
    row: int | None  # trajectory row index, for episodes
    ids: array
    kinds: bytes  # per token: b"p" prompt, b"o" observation, b"s" trained/completion
    logprobs: array | None
    leaf: str | None  # the call whose conversation is shown
    facts: dict[str, str]
    turns: list[Turn] = []


class Piece(msgspec.Struct, array_like=True):
    kind: str  # CSS classes
    text: str
    newline: bool
    position: int


class Pair(msgspec.Struct, kw_only=True):
    index: int
    a: Turn | None
    b: Turn | None
    same: bool


def diverging(a: array, b: array) -> int | None:
    """The first position where the two token sequences differ; None when identical."""
    common = _common(a.tobytes(), b.tobytes())
    return None if common == len(a) == len(b) else common


def aligned(a: list[Turn], b: list[Turn]) -> tuple[list[Pair], int | None]:
    """The two conversations message by message, and the first message that differs."""
    pairs = [Pair(index=i, a=x, b=y, same=_same(x, y))
             for i, (x, y) in enumerate(zip_longest(a, b))]
    first = next((p.index for p in pairs if not p.same), None)
    return pairs, first


def _same(a: Turn | None, b: Turn | None) -> bool:
    if a is None or b is None:
        return False
    return (a.role, a.text, a.tool_calls, a.tool_call_id) == (
        b.role, b.text, b.tool_calls, b.tool_call_id)


def pieces(side: Side, start: int, end: int, texts: dict[int, str],
           mark: int | None) -> list[Piece]:
    out = []
    for pos in range(start, min(end, len(side.ids))):
        token_id = side.ids[pos]
        kind = {ord("p"): "p", ord("o"): "o"}.get(side.kinds[pos], "s")
        if kind == "s" and side.logprobs is not None:
            kind += " " + _band(side.logprobs[pos])
        if pos == mark:
            kind += " dv"
        text = texts.get(token_id)
        if text is None:
            out.append(Piece(kind + " u", f"[{token_id}]", False, pos))
        else:
            out.append(Piece(kind, text, "\n" in text, pos))
    return out


def _row_index(request: web.Request, name: str) -> int:
    value = request.query.get(name, "").strip() or "0"
    if not value.isdigit():
        raise BadParameter(f"{name} must be a row number (0 is the first row)")
    return int(value)


async def _episode_side(request: web.Request, name: str, episode_id: str, index: int) -> Side:
    if not EPISODE_ID.match(episode_id):
        raise BadParameter(f"{name}: {episode_id!r} is not an episode id")
    engine = await request.app[SOURCE].engine()
    info = await details.episode_info(engine, episode_id)
    if info is None:
        raise BadParameter(f"{name}: no episode {episode_id!r} in this database")
    rows = await request.app[ROWS].rows(await request.app[SOURCE].reader(), episode_id)
    facts = {"reward": _text(info.reward), "outcome": info.outcome or DASH,
             "task": info.task_id or DASH, "harness": info.harness_name or DASH}
    if not rows and index == 0:  # no call with token ids: its facts still compare
        return Side(name=name, title=f"{episode_id} (no trajectory)",
                    href=f"{PREFIX}/episodes/{episode_id}", episode_id=episode_id, row=None,
                    ids=array("i"), kinds=b"", logprobs=None,
                    leaf=info.calls[-1].call_id if info.calls else None,
                    facts={**facts, "tokens": "0 (no call with token ids)"})
    if index >= len(rows):
        raise BadParameter(f"{name}: episode {episode_id!r} has {len(rows)} rows "
                           f"(t{name.lower()} counts from 0)")
    row = rows[index]
    kinds = bytearray(row.mask.translate(_KINDS))  # mask 1: trained, 0: observation
    kinds[:row.n_prompt] = b"p" * row.n_prompt
    reason = "main line" if row.reason is None else row.reason
    return Side(
        name=name, title=f"{episode_id}, row {index + 1} ({reason})",
        href=f"{PREFIX}/episodes/{episode_id}?t={index}", episode_id=episode_id, row=index,
        ids=row.ids, kinds=bytes(kinds), logprobs=row.logprobs,
        leaf=row.trajectory.call_ids[-1],
        facts={**facts, "tokens": f"{row.total:,} ({row.trained:,} trained)",
               "rows": str(len(rows))})


async def _call_side(request: web.Request, name: str, call_id: str) -> Side:
    if not CALL_ID.match(call_id):
        raise BadParameter(f"{name}: {call_id!r} is not a call id")
    engine = await request.app[SOURCE].engine()
    stored = await details.stored_call(engine, call_id)
    if stored is None:
        raise BadParameter(f"{name}: no call {call_id!r} in this database")
    found = None
    if stored.episode_id is not None:
        _, calls = await episode_rows(await request.app[SOURCE].reader(), stored.episode_id)
        found = next((c for c in calls if c.call_id == call_id), None)
    ids, kinds, logprobs = _call_tokens(found)
    s = stored.summary
    return Side(
        name=name, title=f"call {s.seq} of {stored.episode_id or 'no episode'}",
        href=f"{PREFIX}/calls/{call_id}", episode_id=stored.episode_id, row=None, ids=ids,
        kinds=kinds, logprobs=logprobs, leaf=call_id,
        facts={"status": f"{s.status} {s.http_status}", "model": s.model or DASH,
               "policy": s.policy_version or DASH, "tokens": f"{len(ids):,}"})


def _call_tokens(call: ScannedCall | None) -> tuple[array, bytes, array | None]:
    """A call's prompt then its first choice's completion: ids, kinds, logprobs."""
    ids = array("i")
    if call is None or not call.prompt_ids:
        return ids, b"", None
    ids.frombytes(call.prompt_ids)
    prompt = len(ids)
    choice = next((c for c in call.choices if c.index == 0), None)
    if choice is None or not choice.completion_ids:
        return ids, b"p" * prompt, None
    ids.frombytes(choice.completion_ids)
    logprobs = None
    if choice.completion_logprobs:
        logprobs = array("d", bytes(8 * prompt))
        logprobs.frombytes(choice.completion_logprobs)
    kinds = b"p" * prompt + b"s" * (len(ids) - prompt)
    return ids, kinds, logprobs if logprobs is not None and len(logprobs) == len(ids) else None


def _text(reward: float | None) -> str:
    return DASH if reward is None else f"{reward:g}"


async def episodes_page(request: web.Request) -> web.Response:
    """``?a=EPISODE&b=EPISODE[&ta=ROW&tb=ROW]``; ``?e=A&e=B`` (ticked in the list) too."""
    ticked = request.query.getall("e", [])
    if ticked:
        if len(ticked) != 2:
            raise BadParameter(f"tick exactly two episodes to compare ({len(ticked)} ticked)")
        raise web.HTTPSeeOther(f"{PREFIX}/compare?" + urlencode({"a": ticked[0], "b": ticked[1]}))
    a, b = request.query.get("a", "").strip(), request.query.get("b", "").strip()
    if not a or not b:
        raise BadParameter("name two episodes: ?a=EPISODE&b=EPISODE (rows: &ta=0&tb=1)")
    sides = [await _episode_side(request, "A", a, _row_index(request, "ta")),
             await _episode_side(request, "B", b, _row_index(request, "tb"))]
    return await _render(request, sides, "episodes")


async def calls_page(request: web.Request) -> web.Response:
    """``?a=CALL&b=CALL``: two calls' prompts and first completions."""
    a, b = request.query.get("a", "").strip(), request.query.get("b", "").strip()
    if not a or not b:
        raise BadParameter("name two calls: ?a=CALL_ID&b=CALL_ID")
    sides = [await _call_side(request, "A", a), await _call_side(request, "B", b)]
    return await _render(request, sides, "calls")


async def _render(request: web.Request, sides: list[Side], what: str) -> web.Response:
    engine = await request.app[SOURCE].engine()
    bodies = await details.call_bodies(engine, [s.leaf for s in sides if s.leaf])
    for side in sides:
        if side.leaf in bodies:
            side.turns = conversation.turns(request.app[READERS], *bodies[side.leaf])
    a, b = sides
    position = diverging(a.ids, b.ids)
    start = max(0, (position or 0) - BEFORE)
    end = (position or 0) + AFTER
    wanted = {*tokenmask.around(a.ids, start, end), *tokenmask.around(b.ids, start, end)}
    texts = await request.app[DETOKENIZER].texts(sorted(wanted))
    pairs, first_turn = aligned(a.turns, b.turns)
    # A credential's tokens drawn as the token view draws them (viewer.tokenmask).
    hidden = {s.name: tokenmask.hidden(s.ids, [(start, end)], texts) for s in sides}
    views = [[Piece(p.kind + " h", tokenmask.MARK, False, p.position)
              if p.position in hidden[s.name] else p for p in pieces(s, start, end, texts,
                                                                     position)]
             for s in sides]
    return page(request, "compare.html", view="compare", what=what, sides=sides,
                position=position, start=start, views=views, pairs=pairs,
                first_turn=first_turn, shown=SHOWN_DIVERGING, texts=texts, hidden=hidden,
                MARK=tokenmask.MARK)
