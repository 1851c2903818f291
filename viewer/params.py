"""Query strings of the episodes pages → storage.browse.EpisodeQuery, and back into links.

A bad value is a clear 400 page naming the field, never a silently dropped filter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import datetime, timezone
from urllib.parse import urlencode

from tracetap.storage.browse import SORTS, STATUSES, EpisodeQuery

PAGE_SIZES = (25, 50, 100, 200)
FILTERS = ("q", "group", "task", "harness", "outcome", "status", "finished", "reward_min",
           "reward_max", "since", "until")
FIELDS = (*FILTERS, "sort", "order", "limit", "page")
TEXT_LIMIT = 256


class BadParameter(ValueError):
    pass


def episode_query(params: Mapping[str, str]) -> EpisodeQuery:
    def text(name: str) -> str | None:
        value = params.get(name, "").strip()
        if len(value) > TEXT_LIMIT:
            raise BadParameter(f"{name} is longer than {TEXT_LIMIT} characters")
        return value or None

    finished = {"yes": True, "no": False, None: None}.get(text("finished"), "bad")
    if finished == "bad":
        raise BadParameter("finished must be yes or no")
    status = text("status")
    if status is not None and status not in STATUSES:
        raise BadParameter(f"status must be one of {', '.join(STATUSES)}")
    sort = text("sort") or "created"
    if sort not in SORTS:
        raise BadParameter(f"sort must be one of {', '.join(SORTS)}")
    order = text("order") or "desc"
    if order not in ("asc", "desc"):
        raise BadParameter("order must be asc or desc")
    limit = _int(params, "limit", 50)
    if limit not in PAGE_SIZES:
        raise BadParameter(f"limit must be one of {', '.join(map(str, PAGE_SIZES))}")
    page = _int(params, "page", 1)
    if page < 1:
        raise BadParameter("page must be 1 or more")
    return EpisodeQuery(
        search=text("q"), group_id=text("group"), task_id=text("task"),
        harness=text("harness"), outcome=text("outcome"), status=status, finished=finished,
        reward_min=_float(params, "reward_min"), reward_max=_float(params, "reward_max"),
        since=_time(params, "since"), until=_time(params, "until"), sort=sort,
        descending=order == "desc", limit=limit, offset=(page - 1) * limit)


def _int(params: Mapping[str, str], name: str, default: int) -> int:
    value = params.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise BadParameter(f"{name} must be an integer") from None


def _float(params: Mapping[str, str], name: str) -> float | None:
    value = params.get(name, "").strip()
    if not value:
        return None
    try:
        number = float(value)
    except ValueError:
        raise BadParameter(f"{name} must be a number") from None
    if not math.isfinite(number):
        raise BadParameter(f"{name} must be a finite number")
    return number


def _time(params: Mapping[str, str], name: str) -> float | None:
    """``2026-01-02T03:04`` (a datetime-local field, read as UTC) or epoch seconds."""
    value = params.get(name, "").strip()
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise BadParameter(f"{name} must be a time such as 2026-01-02T03:04 (UTC)") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()


def link(params: Mapping[str, str], **changes: str | int | None) -> str:
    """The same query with some fields changed (None removes one); empty fields dropped."""
    merged = {k: params.get(k, "") for k in FIELDS}
    for key, value in changes.items():
        merged[key] = "" if value is None else str(value)
    kept = {k: v for k, v in merged.items() if v}
    return "?" + urlencode(kept) if kept else "?"


def filters(params: Mapping[str, str]) -> dict[str, str]:
    return {k: params.get(k, "") for k in FIELDS}
