"""A rerun of ``tracetap engineer`` with the same run id goes on where the last one ended:
the baseline and every batch resume as ``tracetap run``'s do (finished episodes are
skipped), a candidate whose engineer episode is finished is kept as it was judged (its
row rebuilt from the episode's ``info``), and one registered but not finished (the run
stopped between asking and finishing) is judged from the reply its episode recorded,
never asked again (a second call would make its trajectory two)."""

from __future__ import annotations

import json
from typing import Any

from tracetap.analysis.episodes import open_reader
from tracetap.storage.summaries import call_summaries


async def recorded_reply(db: str, episode_id: str) -> str | None:
    """The engineer's text in the episode's last recorded call; None if there is none."""
    async with open_reader(db) as reader:
        calls = await call_summaries(reader, [episode_id])
        if not calls:
            return None
        last = calls[-1].call_id
        bodies = await reader.bodies([last])
    body = bodies.get(last)
    try:
        return json.loads(body.response)["choices"][0]["message"]["content"]
    except (AttributeError, TypeError, ValueError, KeyError, IndexError):
        return None


def judged(info: dict[str, Any] | None, reward: float | None) -> dict[str, Any] | None:
    """The row fields a finished engineer episode recorded (``_finish`` wrote them)."""
    if info is None or reward is None or "valid" not in info:
        return None
    fields = {
        "patch": info.get("patch"),
        "sha256": info.get("sha256"),
        "valid": bool(info["valid"]),
        "why": info.get("invalid"),
        "reward": reward,
        "advantage": info.get("advantage"),
    }
    if info["valid"]:
        fields.update(
            delta=info.get("delta"),
            interval=tuple(info["interval"]) if info.get("interval") else None,
            fixed=info.get("fixed", []),
            broken=info.get("broken", []),
            held_out_tasks=info.get("held_out_tasks", 0),
            held_out_delta=info.get("held_out_delta"),
            held_out_interval=(
                tuple(info["held_out_interval"]) if info.get("held_out_interval") else None
            ),
            reward_from=info.get("reward_from"),
        )
    return fields
