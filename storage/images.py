"""Image payloads inside request bodies: found, cut out as blocks of their own, kept as bytes.

A screenshot travels as base64 text in every API's request: chat's ``image_url`` data URL,
Responses' ``input_image`` data URL, Messages' ``image`` block (``"data": "<base64>"``).
The same picture is then held in JSON pieces that differ (a Messages request and the chat
body it was translated to, a turn that resends it next to other text), so message-level
blocks (storage.blocks) would store it once per shape. Here the payload itself is cut out
of the text it sits in: it is one block, named by its decoded bytes
(``digest(IMAGE, bytes)``), in whichever body and shape it appears, and stored as those
bytes (a quarter smaller than the text). Reading the block gives the base64 text back
(storage.blocks.unpack_block), so a body joins back byte for byte.

Only canonical base64 is cut (the text is exactly what ``base64.b64encode`` gives for its
bytes: standard alphabet, padded, no line breaks, zero padding bits); anything else stays
in the text around it, stored as text. Pure functions: no database here.
"""

from __future__ import annotations

import base64
import binascii
import re

IMAGE = b"image"  # the kind an image block's hash is made with (storage.blocks.digest)
FORM = 5  # the format byte of a stored image block (storage.blocks.pack_block)
# Shorter payloads are not worth a block of their own (a reference costs 20 bytes).
MIN_PAYLOAD = 1024
# Payloads cut out of one segment at most: the rest stays text (bounds the rows a body of
# many tiny images makes, as storage.blocks.MAX_CUT_ELEMENTS bounds its messages).
MAX_PER_SEGMENT = 256
# A data URL's payload (chat, Responses) or a JSON "data" member's (Messages' base64 image
# source), up to the closing quote. The character class runs in C: linear in the payload.
_PAYLOAD = re.compile(
    r'(?:data:[A-Za-z0-9.+/-]{1,100};base64,|"data"\s*:\s*")'
    rf'([A-Za-z0-9+/]{{{MIN_PAYLOAD},}}={{0,2}})"')


class Base64Text(bytes):
    """A payload as it is in the body (its UTF-8 bytes), with the bytes it encodes:
    storage.blocks.pack_block stores these, not the text."""

    raw: bytes

    def __new__(cls, text: bytes, raw: bytes) -> Base64Text:
        self = super().__new__(cls, text)
        self.raw = raw
        return self


def split(segment: str) -> list[tuple[str, bytes | None]]:
    """``segment`` as pieces that join back to it: text (None) and image payloads (their
    decoded bytes). Most segments hold none: one piece, found with one regex scan."""
    out: list[tuple[str, bytes | None]] = []
    at = 0
    for match in _PAYLOAD.finditer(segment):
        if len(out) >= 2 * MAX_PER_SEGMENT:
            break
        raw = decoded(match.group(1))
        if raw is None:
            continue
        start, end = match.span(1)
        if start > at:
            out.append((segment[at:start], None))
        out.append((match.group(1), raw))
        at = end
    if at < len(segment) or not out:
        out.append((segment[at:], None))
    return out


def decoded(payload: str) -> bytes | None:
    """The bytes canonical base64 ``payload`` encodes; None when it is not canonical (it
    would not be given back as it was sent) or not base64 at all."""
    if len(payload) % 4:
        return None
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return None
    if base64.b64encode(raw).decode("ascii") != payload:  # nonzero padding bits
        return None
    return raw


def encoded(raw: bytes) -> bytes:
    """An image block's stored bytes back as the payload text (UTF-8)."""
    return base64.b64encode(raw)
