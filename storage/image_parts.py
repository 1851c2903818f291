"""The images of a request body, in the order the model reads them: for the export and the
viewer.

One walk serves the three APIs' shapes, in document order: chat's ``{"type":
"image_url", "image_url": {"url"}}`` (or the bare string), Responses' ``{"type":
"input_image", "image_url"}``, Messages' ``{"type": "image", "source": {"type": "base64",
"media_type", "data"} | {"type": "url", "url"}}`` (tool results' nested content too). A
data URL or base64 source gives the image's bytes; any other URL is kept as it is (never
fetched). Malformed parts are skipped, never raised: the body is what an agent sent.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import msgspec

from tracetap.storage.images import decoded

# Magic numbers of the raster types the viewer serves and the export names; anything
# else (SVG above all: it can carry script) is "application/octet-stream".
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"),
          (b"GIF87a", "image/gif"), (b"GIF89a", "image/gif"))
OCTETS = "application/octet-stream"
_DATA_URL = re.compile(r"data:([^;,]{0,100})((?:;[^;,]{0,100}){0,8}),", re.S)
# A body that names no image type is not decoded at all (one substring scan, in C): the
# export reads every call's body, nearly all of them without images.
_MAYBE = re.compile(r'"(?:image_url|input_image|image)"')
MAX_DEPTH = 64  # deeper JSON is not walked (an agent's nesting costs nothing here)


class ImagePart(msgspec.Struct, frozen=True, kw_only=True):
    """One image: its bytes (``data``, None for a URL that is not data:), their SHA-256
    (hex) and real type (sniffed from the bytes, not taken from the request), or ``url``."""

    sha256: str | None = None
    media_type: str | None = None
    data: bytes | None = None
    url: str | None = None


def sniff(data: bytes) -> str:
    """The image type ``data`` really is (by its first bytes), or OCTETS."""
    for magic, kind in _MAGIC:
        if data.startswith(magic):
            return kind
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return OCTETS


def from_bytes(data: bytes) -> ImagePart:
    return ImagePart(sha256=hashlib.sha256(data).hexdigest(), media_type=sniff(data),
                     data=data)


def from_url(url: str) -> ImagePart | None:
    """A data URL's image (None when it is not base64 that reads back as it was sent),
    or any other URL as it is."""
    match = _DATA_URL.match(url)
    if match is None:
        return ImagePart(url=url) if not url.startswith("data:") else None
    if ";base64" not in match.group(2):
        return None
    data = decoded(url[match.end():])
    return None if data is None else from_bytes(data)


def image_parts(body: str | None) -> list[ImagePart]:
    """The images of a request body (JSON text), in document order; [] for no JSON."""
    if not body or _MAYBE.search(body) is None:
        return []
    try:
        value = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):  # not JSON, or nested past the stack
        return []
    out: list[ImagePart] = []
    _walk(value, out, 0)
    return out


def _walk(value: Any, out: list[ImagePart], depth: int) -> None:
    if depth > MAX_DEPTH:
        return
    if isinstance(value, list):
        for item in value:
            _walk(item, out, depth + 1)
        return
    if not isinstance(value, dict):
        return
    part = image_of(value)
    if part is not None:
        out.append(part)
        return
    for item in value.values():
        if isinstance(item, (list, dict)):
            _walk(item, out, depth + 1)


def image_of(value: dict) -> ImagePart | None:
    """The image ``value`` is (an unreadable one: all fields None, so that the images
    after it keep their places), or None when it is no image part."""
    part = _image(value)
    return part if part is not None or value.get("type") not in _KINDS else ImagePart()


_KINDS = frozenset({"image_url", "input_image", "image"})


def _image(value: dict) -> ImagePart | None:
    kind = value.get("type")
    if kind == "image_url":
        url = value.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        return from_url(url) if isinstance(url, str) else None
    if kind == "input_image":
        url = value.get("image_url")
        return from_url(url) if isinstance(url, str) else None
    if kind == "image" and isinstance(value.get("source"), dict):
        source = value["source"]
        if source.get("type") == "base64" and isinstance(source.get("data"), str):
            data = decoded(source["data"])
            return None if data is None else from_bytes(data)
        if source.get("type") == "url" and isinstance(source.get("url"), str):
            return from_url(source["url"])
    return None
