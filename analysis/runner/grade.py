"""A reward from a grader's output or, without one, from the harness's exit status."""

from __future__ import annotations

import math
from typing import Any

import msgspec

from tracetap.analysis.runner.admin import Finish
from tracetap.analysis.runner.outcomes import FAILURE, SUCCESS


class GraderError(ValueError):
    pass


class _Graded(msgspec.Struct, forbid_unknown_fields=True):
    reward: float | None = None
    rewards: dict[str, float] | None = None
    outcome: str | None = None
    info: dict[str, Any] | None = None


def from_exit(code: int) -> Finish:
    """No grader: exit 0 is a success (reward 1), anything else a failure (reward 0)."""
    if code == 0:
        return Finish(reward=1.0, outcome=SUCCESS)
    return Finish(reward=0.0, outcome=FAILURE, info={"exit_code": code})


def from_output(stdout: bytes) -> Finish:
    """The grader's stdout: a number (the reward) or a JSON object ``{reward, rewards,
    outcome, info}``; its last non-empty line counts, so a grader may log before it."""
    lines = [line for line in stdout.decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        raise GraderError("the grader printed nothing")
    last = lines[-1].strip()
    try:
        value = msgspec.json.decode(last)
    except msgspec.DecodeError:
        raise GraderError(
            f"the grader's last line is not a number or JSON: {last[:200]!r}"
        ) from None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        graded = _Graded(reward=float(value))
    elif isinstance(value, dict):
        try:
            graded = msgspec.convert(value, _Graded)
        except msgspec.ValidationError as exc:
            raise GraderError(f"the grader's JSON: {exc}") from None
    else:
        raise GraderError(f"the grader's last line is not a number or an object: {last[:200]!r}")
    values = [graded.reward, *(graded.rewards or {}).values()]
    if any(v is not None and not math.isfinite(v) for v in values):
        raise GraderError("the grader's rewards must be finite numbers")
    return Finish(
        reward=graded.reward, rewards=graded.rewards, outcome=graded.outcome, info=graded.info
    )
