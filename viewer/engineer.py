"""An engineer round in the viewer (``tracetap engineer``, docs/harness-engineering.md):
the K candidates of one group, each with its validity (or why it is invalid), its Δ_B on
the whole batch and on the held-out tasks with their intervals, its reward, and its
advantage as the trainer computes it: (reward - group mean) / population std over every
candidate of the group, invalid ones included with their penalty.

Everything shown is what the loop recorded on each engineer episode (its reward, outcome
and ``info``); the advantages are computed here from those rewards, so the page shows
exactly what a GRPO update of the engineer would see."""

from __future__ import annotations

import json
from typing import Any

import msgspec
from aiohttp import web

from tracetap.analysis.episodes import Episode, read
from tracetap.analysis.stats import normalised
from tracetap.storage.scan import EpisodeFilter
from tracetap.viewer.keys import SOURCE
from tracetap.viewer.render import page


class Candidate(msgspec.Struct, kw_only=True):
    episode_id: str
    candidate: int | None
    patch: str | None
    valid: bool
    why: str | None  # why it is invalid
    delta: float | None  # in-batch Δ_B
    interval: tuple[float, float] | None
    held_out_delta: float | None
    held_out_interval: tuple[float, float] | None
    held_out_tasks: int
    reward: float | None
    reward_from: str | None
    advantage: float | None = None


def candidates(episodes: list[Episode]) -> list[Candidate]:
    """The group's engineer episodes as candidates, in candidate order, with advantages."""
    found = [_candidate(e) for e in episodes if "engineer" in e.metadata]
    found.sort(key=lambda c: (c.candidate is None, c.candidate or 0, c.episode_id))
    rewards = [c.reward for c in found]
    if len(found) >= 2 and None not in rewards:
        for c, advantage in zip(found, normalised(rewards)):
            c.advantage = advantage
    return found


def _candidate(e: Episode) -> Candidate:
    info = _object(e.summary.info)
    return Candidate(
        episode_id=e.id,
        candidate=e.metadata.get("candidate"),
        patch=info.get("patch"),
        valid=bool(info.get("valid")),
        why=info.get("invalid"),
        delta=info.get("delta"),
        interval=_pair(info.get("interval")),
        held_out_delta=info.get("held_out_delta"),
        held_out_interval=_pair(info.get("held_out_interval")),
        held_out_tasks=info.get("held_out_tasks") or 0,
        reward=e.summary.reward,
        reward_from=info.get("reward_from"),
    )


def _object(text: str | None) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _pair(value: Any) -> tuple[float, float] | None:
    if isinstance(value, list) and len(value) == 2:
        return (float(value[0]), float(value[1]))
    return None


async def round_page(request: web.Request) -> web.Response:
    """``/engineer/GROUP``: one engineer round's candidates (the group is the packet, or
    the batch of packets, they answer)."""
    group = request.match_info["group"]
    reader = await request.app[SOURCE].reader()
    episodes = await read(reader, EpisodeFilter(group_id=group, finished_only=False))
    found = candidates(episodes)
    if not found:
        raise web.HTTPNotFound(text=f"no engineer round {group!r}")
    first = next(e for e in episodes if "engineer" in e.metadata)
    return page(request, "engineer.html", view="engineer", group=group, candidates=found,
                packets=first.metadata.get("packets") or [], run=first.metadata["engineer"])
