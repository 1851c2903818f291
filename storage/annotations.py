"""People's annotations: a label, a comment or a corrected reward on an episode, a call or
a token span of a call's choice, with who made it and when.

Made in the viewer (its admin session) or through the admin API (the admin token); never
by an agent. Checked here, once, whoever writes (``check``): sizes, a finite reward, a
span inside the choice's completion tokens, and at most MAX_PER_EPISODE per episode. A corrected
reward is a row of its own: the episode's ``reward`` column is never touched.
"""

from __future__ import annotations

import math
import time
import unicodedata

import msgspec
from sqlalchemy import func, insert, select
from sqlalchemy.ext.asyncio import AsyncEngine

from tracetap.storage.blocks import refs_length
from tracetap.storage.fetch import among
from tracetap.storage.tables import Annotation, Call, Choice, Episode

MAX_LABEL = 64  # characters (annotations.label)
MAX_COMMENT = 4000
MAX_AUTHOR = 128
MAX_ID = 128  # episodes.id; call ids are shorter
MAX_PER_EPISODE = 500
MAX_TOKEN = 10_000_000  # a span's end: beyond any context
MAX_CHOICE = 1024
SOURCES = ("viewer", "api")
_BIDI = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


class Refused(Exception):
    """Why an annotation was not stored (the caller answers 400, 404 or 409)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class NewAnnotation(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a person asks to store. The target: ``episode`` alone, or ``call`` (its
    episode is the call's), with ``choice``, ``start`` and ``end`` for a token span."""

    episode: str | None = None
    call: str | None = None
    choice: int | None = None
    start: int | None = None
    end: int | None = None
    label: str | None = None
    comment: str | None = None
    corrected_reward: float | None = None


class Stored(msgspec.Struct, kw_only=True):
    id: int
    episode_id: str
    call_id: str | None
    choice_index: int | None
    token_start: int | None
    token_end: int | None
    label: str | None
    comment: str | None
    corrected_reward: float | None
    author: str
    source: str
    created_at: float

    @property
    def target(self) -> str:
        if self.call_id is None:
            return "episode"
        return "call" if self.token_start is None else "span"


_COLUMNS = (Annotation.id, Annotation.episode_id, Annotation.call_id, Annotation.choice_index,
            Annotation.token_start, Annotation.token_end, Annotation.label, Annotation.comment,
            Annotation.corrected_reward, Annotation.author, Annotation.source,
            Annotation.created_at)
_NAMES = [c.key for c in _COLUMNS]


def _text(value: str | None, name: str, limit: int) -> str | None:
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    if len(value) > limit:
        raise Refused(f"{name} is longer than {limit} characters")
    # Control characters (but a comment's newlines and tabs) and bidirectional overrides
    # would hide or reorder text on a page.
    if any((unicodedata.category(c) == "Cc" and c not in "\n\t") or c in _BIDI
           for c in value):
        raise Refused(f"{name} holds control characters")
    return value


def check(new: NewAnnotation) -> NewAnnotation:
    """``new`` with its texts trimmed, or Refused saying what is wrong."""
    label = _text(new.label, "label", MAX_LABEL)
    if label is not None and "\n" in label:
        raise Refused("label is one line")
    comment = _text(new.comment, "comment", MAX_COMMENT)
    reward = new.corrected_reward
    if reward is not None and not math.isfinite(reward):
        raise Refused("corrected_reward must be a finite number")
    if label is None and comment is None and reward is None:
        raise Refused("an annotation needs a label, a comment or a corrected_reward")
    _check_target(new)
    return msgspec.structs.replace(new, label=label, comment=comment)


def _check_target(new: NewAnnotation) -> None:
    if (new.episode is None) == (new.call is None):
        raise Refused("name the episode or the call (one of them)")
    if len(new.episode or new.call) > MAX_ID:
        raise Refused(f"an episode or call id is at most {MAX_ID} characters")
    span = (new.choice, new.start, new.end)
    if any(v is not None for v in span):
        if new.call is None or any(v is None for v in span):
            raise Refused("a token span is call, choice, start and end together")
        if not 0 <= new.choice < MAX_CHOICE:
            raise Refused(f"choice must be 0 to {MAX_CHOICE - 1}")
        if not 0 <= new.start < new.end <= MAX_TOKEN:
            raise Refused("a token span needs 0 <= start < end (end exclusive)")
    if new.corrected_reward is not None and new.call is not None:
        raise Refused("a corrected reward is an episode's: name the episode, not a call")


async def add(engine: AsyncEngine, new: NewAnnotation, *, author: str, source: str,
              now: float | None = None) -> Stored:
    """Store ``new`` (checked first); Refused when its target is not in the database or
    the episode holds MAX_PER_EPISODE already."""
    new = check(new)
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}")
    author = author[:MAX_AUTHOR]
    async with engine.begin() as conn:
        if new.call is not None:
            episode_id = (await conn.execute(
                select(Call.episode_id).where(Call.call_id == new.call))).scalar()
            if episode_id is None:
                raise Refused(f"no call {new.call!r} in an episode", 404)
            if new.choice is not None:
                await _span_fits(conn, new)
        else:
            episode_id = (await conn.execute(
                select(Episode.id).where(Episode.id == new.episode))).scalar()
            if episode_id is None:
                raise Refused(f"no episode {new.episode!r}", 404)
        count = (await conn.execute(select(func.count()).select_from(Annotation).where(
            Annotation.episode_id == episode_id))).scalar_one()
        if count >= MAX_PER_EPISODE:
            raise Refused(f"episode {episode_id!r} has {MAX_PER_EPISODE} annotations, the "
                          "most one episode may hold", 409)
        values = {"episode_id": episode_id, "call_id": new.call, "choice_index": new.choice,
                  "token_start": new.start, "token_end": new.end, "label": new.label,
                  "comment": new.comment, "corrected_reward": new.corrected_reward,
                  "author": author, "source": source,
                  "created_at": time.time() if now is None else now}
        result = await conn.execute(insert(Annotation).values(**values)
                                    .returning(Annotation.id))
        return Stored(id=result.scalar_one(), **values)


async def _span_fits(conn, new: NewAnnotation) -> None:
    row = (await conn.execute(
        select(func.length(Choice.completion_ids), Choice.completion_ids_refs).where(
            Choice.call_id == new.call, Choice.choice_index == new.choice))).first()
    if row is None:
        raise Refused(f"call {new.call!r} has no choice {new.choice}", 404)
    tokens = refs_length(row[1]) if row[1] is not None else (row[0] or 0) // 4
    if new.end > tokens:
        raise Refused(f"choice {new.choice} of call {new.call!r} has {tokens} completion "
                      f"tokens: the span must end at or before {tokens}")


async def of_episodes(engine: AsyncEngine, episode_ids: list[str]) -> list[Stored]:
    """The annotations of these episodes (theirs, their calls', their spans'), oldest
    first."""
    if not episode_ids:
        return []
    query = select(*_COLUMNS).where(among(Annotation.episode_id, sorted(set(episode_ids)),
                                          engine)).order_by(Annotation.id)
    return await _read(engine, query)


async def of_call(engine: AsyncEngine, call_id: str) -> list[Stored]:
    query = select(*_COLUMNS).where(Annotation.call_id == call_id).order_by(Annotation.id)
    return await _read(engine, query)


async def every(engine: AsyncEngine) -> list[Stored]:
    """Every annotation, oldest first (the export's ``annotations/`` snapshot)."""
    return await _read(engine, select(*_COLUMNS).order_by(Annotation.id))


async def labels_of(engine: AsyncEngine, episode_ids: list[str]) -> dict[str, set[str]]:
    """Episode id → the labels on it, its calls and their spans (the ``label`` selector).
    Reads the distinct labelled pairs (people make few) and keeps those of
    ``episode_ids``: an analysis of 50,000 episodes sends no list of them."""
    wanted = set(episode_ids)
    if not wanted:
        return {}
    query = select(Annotation.episode_id, Annotation.label).where(
        Annotation.label.is_not(None)).distinct()
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    found: dict[str, set[str]] = {}
    for episode_id, label in rows:
        if episode_id in wanted:
            found.setdefault(episode_id, set()).add(label)
    return found


async def _read(engine: AsyncEngine, query) -> list[Stored]:
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    return [Stored(**dict(zip(_NAMES, row, strict=True))) for row in rows]

