"""Images of a conversation: the text that stands for one in a turn, and the route that
serves its bytes as a thumbnail.

Served only as what the bytes really are (storage.image_parts.sniff: PNG, JPEG, GIF,
WebP), never as the type the agent claimed: an SVG (which can carry script) or anything
else is refused with 404, so no agent-chosen content is ever rendered as active content.
The viewer's gate (viewer.app) guards the route like every page; its security headers
(``X-Content-Type-Options: nosniff``, the CSP) are on the answer.
"""

from __future__ import annotations

import re

from aiohttp import web

from tracetap.storage.image_blocks import image_bytes, key
from tracetap.storage.image_parts import OCTETS, ImagePart, image_of, sniff
from tracetap.viewer.keys import SOURCE

MARK = re.compile(r"\[image ([0-9a-f]{32})\]")  # a stored image named in a turn's text


def mark(part: dict) -> str | None:
    """The text a turn shows for an image part (None: ``part`` is no image): ``[image
    <key>]`` for an image whose bytes are stored, its URL for another, else ``[image]``."""
    image: ImagePart | None = image_of(part)
    if image is None:
        return None
    if image.data is not None:
        return f"[image {key(image.data)}]"
    return f"[image {image.url}]" if image.url else "[image]"


async def serve(request: web.Request) -> web.Response:
    engine = await request.app[SOURCE].engine()
    data = await image_bytes(engine, request.match_info["key"])
    kind = sniff(data) if data is not None else OCTETS
    if kind == OCTETS:
        raise web.HTTPNotFound(text="no such image")
    return web.Response(body=data, content_type=kind, headers={
        "Content-Disposition": "inline", "Cache-Control": "private, max-age=86400"})
