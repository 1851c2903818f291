"""Jinja2 templates (autoescaped, HTML and SVG alike) and the small formatters they use."""

from __future__ import annotations

import functools
import time
from typing import Any

import jinja2
from aiohttp import web

from tracetap.viewer import PREFIX
from tracetap.viewer.callinfo import status_label
from tracetap.viewer.charts import seconds
from tracetap.viewer.conversation import open_from, preview
from tracetap.viewer.keys import TEMPLATES
from tracetap.viewer.tokens import REASONS


def _when(t: float | None) -> str:
    if t is None:
        return "\u2013"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


def _reward(v: float | None) -> str:
    if v is None:
        return "\u2013"
    return f"{v:.3f}".rstrip("0").rstrip(".") if v != int(v) else f"{v:.1f}"


def _count(v: int | None) -> str:
    return "\u2013" if v is None else f"{v:,}"


def _reward_class(v: float | None) -> str:
    """A colour band for a reward in [0, 1] (other ranges still get a neutral one)."""
    if v is None:
        return "rn"
    if v <= 0:
        return "r0"
    if v < 0.5:
        return "r1"
    if v < 1:
        return "r2"
    return "r3"


@functools.cache
def _environment() -> jinja2.Environment:
    """The package's templates, one environment per process: its options, filters and
    globals never change, so every app (a restart in process, a test's proxy, the viewer
    mounted beside `tracetap view`) shares what it compiled (~0.3 s of CPU each time)."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("tracetap.viewer", "templates"),
        autoescape=True,  # every template, .svg included
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(when=_when, secs=seconds, reward=_reward, count=_count,
                       reward_class=_reward_class, status=status_label,
                       preview=preview)
    env.globals.update(PREFIX=PREFIX, REASONS=REASONS, open_from=open_from)
    return env


class Templates:
    def __init__(self) -> None:
        self.env = _environment()

    def warm(self) -> None:
        """Compile every template now (at start), not inside a reader's first request."""
        for name in self.env.list_templates():
            self.env.get_template(name)

    def render(self, name: str, **context: Any) -> str:
        return self.env.get_template(name).render(**context)


def page(request: web.Request, name: str, *, status: int = 200,
         content_type: str = "text/html", **context: Any) -> web.Response:
    text = request.app[TEMPLATES].render(name, request=request, **context)
    return web.Response(text=text, status=status, content_type=content_type, charset="utf-8")
