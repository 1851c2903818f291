"""A body's message prefix as the writer's cache keeps it: its text, less its images.

The writer remembers each conversation's last request up to the end of its last message
(storage.dedup.Last), so that the next call, which resends it first, is recognised without
hashing it again: only what follows is scanned. Kept verbatim, a screenshot agent's prefix
holds every screenshot it ever sent as base64 (about 8 MB at 30 turns of 200 KB), and a
64 MiB cache would hold 8 such conversations. Here each image payload is kept as its
length and a keyed 64-bit hash of its text instead (its bytes are stored once already,
as a block of their own: storage.images), so a conversation costs about its text.

A resent payload is checked against that hash: Python's ``hash`` of a str is SipHash-1-3
under a 128-bit key drawn at each start (unless PYTHONHASHSEED pins it) and never leaves
the process, so a payload crafted to pass for another would need the key; it runs at
about the speed of the comparison it replaces. Text between the images is compared as it
was.
"""

from __future__ import annotations

from collections.abc import Iterable

Ref = tuple[bytes, int]  # a block's hash and length (storage.blocks.Ref)
# Text kept as it is, or an image payload as (its length, the hash of its text).
Piece = str | tuple[int, int]
_IMAGE_COST = 64  # bytes an image's entry costs the cache, about


class Prefix:
    """A prefix's pieces, the references of its blocks, its length in characters and what
    it costs the cache in bytes (about)."""

    __slots__ = ("length", "pieces", "refs", "size")

    def __init__(self, pieces: tuple[Piece, ...], refs: list[Ref]):
        self.pieces = pieces
        self.refs = refs
        self.length = sum(len(p) if isinstance(p, str) else p[0] for p in pieces)
        self.size = sum(len(p) if isinstance(p, str) else _IMAGE_COST for p in pieces)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Prefix) and self.pieces == other.pieces
                and self.refs == other.refs)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Prefix({self.pieces!r}, {self.refs!r})"

    def extended(self, pieces: Iterable[Piece], refs: list[Ref]) -> Prefix:
        return Prefix(merged([*self.pieces, *pieces]), self.refs + refs)

    def starts(self, text: str) -> bool:
        """Whether ``text`` begins with this prefix, and goes on past it."""
        if len(text) <= self.length:
            return False
        at = 0
        for piece in self.pieces:
            if isinstance(piece, str):
                if not text.startswith(piece, at):
                    return False
                at += len(piece)
            else:
                n, fingerprint = piece
                if hash(text[at:at + n]) != fingerprint:
                    return False
                at += n
        return True


def piece(part: str, image: bool) -> Piece:
    """One piece of a segment (storage.images.split): an image payload by its hash."""
    return (len(part), hash(part)) if image else part


def merged(pieces: Iterable[Piece]) -> tuple[Piece, ...]:
    """Adjacent text pieces joined: fewer comparisons, and a text's own characters only."""
    out: list[Piece] = []
    run: list[str] = []
    for p in pieces:
        if isinstance(p, str):
            run.append(p)
            continue
        if run:
            out.append("".join(run))
            run = []
        out.append(p)
    if run:
        out.append("".join(run))
    return tuple(p for p in out if p != "")
