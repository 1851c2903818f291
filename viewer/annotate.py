"""Annotations made in the viewer: the form's POST, and what a page lists.

Behind the viewer's gate (the admin session or token; an episode key is refused there),
and only from the viewer's own pages (``access.same_origin``, with the SameSite=Strict
session cookie): another site cannot make a logged-in browser post one. Who made it is
the session (its nonce, which the cookie carries and the HMAC signs) or ``admin token``
for a script that sends the token itself.
"""

from __future__ import annotations

from aiohttp import web

from tracetap.storage import annotations
from tracetap.storage.annotations import NewAnnotation, Refused
from tracetap.viewer import PREFIX, access
from tracetap.viewer.keys import SOURCE
from tracetap.viewer.params import BadParameter
from tracetap.viewer.render import page

LABELS = ("good", "bad")  # offered in the form; any other one-line label is taken too
MAX_FORM = 16 * 1024  # bytes of a posted form


def author_of(request: web.Request) -> str:
    if request.headers.get("Authorization", "").startswith("Bearer "):
        return "admin token"
    cookie = request.cookies.get(access.COOKIE, "")
    parts = cookie.split(".")
    return f"viewer session {parts[1][:8]}" if len(parts) == 3 else "viewer"


def _number(form, name: str, kind: type):
    value = str(form.get(name, "")).strip()
    if not value:
        return None
    try:
        return kind(value)
    except ValueError:
        raise BadParameter(f"{name} must be {'an integer' if kind is int else 'a number'}, "
                           f"not {value[:40]!r}") from None


def _text(form, name: str) -> str | None:
    value = form.get(name)
    return value if isinstance(value, str) else None


async def post(request: web.Request) -> web.Response:
    if not access.same_origin(request):
        raise web.HTTPForbidden(text="cross-site annotation refused")
    if (request.content_length or 0) > MAX_FORM:
        raise BadParameter(f"the form is larger than {MAX_FORM} bytes")
    form = await request.post()
    new = NewAnnotation(
        episode=_text(form, "episode") or None, call=_text(form, "call") or None,
        choice=_number(form, "choice", int), start=_number(form, "start", int),
        end=_number(form, "end", int), label=_text(form, "label"),
        comment=_text(form, "comment"),
        corrected_reward=_number(form, "corrected_reward", float))
    back = access.safe_next(_text(form, "next"), PREFIX)
    engine = await request.app[SOURCE].engine()
    try:
        await annotations.add(engine, new, author=author_of(request), source="viewer")
    except Refused as refused:
        return page(request, "error.html", status=refused.status,
                    title="Annotation not stored", message=str(refused))
    raise web.HTTPSeeOther(back.split("#", 1)[0] + "#annotations")


def reward_note(found: list[annotations.Stored]) -> annotations.Stored | None:
    """The episode's latest corrected reward (shown beside the original)."""
    rewards = [a for a in found if a.corrected_reward is not None and a.call_id is None]
    return rewards[-1] if rewards else None


async def episode_notes(request: web.Request, episode_id: str) -> dict:
    engine = await request.app[SOURCE].engine()
    found = await annotations.of_episodes(engine, [episode_id])
    return {"notes": found, "corrected": reward_note(found), "label_choices": LABELS,
            "note_target": {"episode": episode_id}, "note_next": request.path_qs}


async def call_notes(request: web.Request, call_id: str) -> dict:
    engine = await request.app[SOURCE].engine()
    return {"notes": await annotations.of_call(engine, call_id), "corrected": None,
            "label_choices": LABELS, "note_target": {"call": call_id},
            "note_next": request.path_qs}
