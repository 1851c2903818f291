"""Content-addressed blocks: how a prompt's ids and a request's text are cut, named, packed.

A call stores its prompt ids and its bodies as *references*: a list of (hash, length)
entries naming blocks in the ``blocks`` table, which holds each distinct block once.
Prompt ids are cut into blocks of ``BLOCK_TOKENS`` ids, continuing the boundaries of the
previous call of the same conversation (so the prefix it shares names the same blocks and
only the new tokens make new ones); a conversation's first call is cut from position 0,
so the samples of a GRPO group, which share it, share its blocks. A request is cut at its
messages (``segments``): the JSON before the first message, each message with the
separator before it, and the rest; a message resent in every later turn is stored once.
Pure functions: no database here (storage.dedup plans, storage.inflate reads).
"""

from __future__ import annotations

import hashlib
import re
import struct
import zlib
from collections.abc import Iterable, Iterator
from itertools import pairwise

HASH_BYTES = 16
_ENTRY = struct.Struct("<16sI")  # a reference: the block's hash, its length
ENTRY_BYTES = _ENTRY.size
BLOCK_TOKENS = 512  # ids per prompt block: the list of references stays ~0.04 B/token
IDS, TEXT = b"ids", b"text"  # what a block holds (part of its hash: never confused)
_RAW, _ZLIB = 0, 1  # the first byte of a stored block says how the rest is packed
_MIN_COMPRESS = 64  # bytes; below, zlib's header costs more than it saves

Ref = tuple[bytes, int]  # (hash, length: ids for IDS blocks, UTF-8 bytes for TEXT)


def digest(kind: bytes, data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=HASH_BYTES, person=kind).digest()


def pack_refs(refs: Iterable[Ref]) -> bytes:
    return b"".join(_ENTRY.pack(h, n) for h, n in refs)


def unpack_refs(data: bytes) -> list[Ref]:
    return list(_ENTRY.iter_unpack(bytes(data)))


def refs_length(data: bytes) -> int:
    """The total length the references name (ids of a prompt) without reading a block."""
    return sum(n for _, n in _ENTRY.iter_unpack(bytes(data)))


def pack_block(data: bytes) -> bytes:
    """A block as stored: zlib when that is smaller (level 1: the writer's CPU is the
    proxy's), else as it is."""
    if len(data) >= _MIN_COMPRESS:
        packed = zlib.compress(data, 1)
        if len(packed) < len(data):
            return bytes((_ZLIB,)) + packed
    return bytes((_RAW,)) + data


def unpack_block(stored: bytes) -> bytes:
    stored = bytes(stored)
    if stored[0] == _ZLIB:
        return zlib.decompress(stored[1:])
    if stored[0] == _RAW:
        return stored[1:]
    raise ValueError(f"unknown block format {stored[0]}")


def cut_ids(ids: bytes, parent: list[Ref] | None) -> list[tuple[Ref, bytes]]:
    """The blocks of a prompt (int32 bytes): the parent's boundaries as far as its blocks
    recur, then ``BLOCK_TOKENS`` at a time. Each block comes with its bytes."""
    out: list[tuple[Ref, bytes]] = []
    at = 0
    for h, n in parent or ():
        end = at + 4 * n
        if end > len(ids):
            break
        piece = ids[at:end]
        if digest(IDS, piece) != h:
            break
        out.append(((h, n), piece))
        at = end
    step = 4 * BLOCK_TOKENS
    while at < len(ids):
        piece = ids[at:at + step]
        out.append(((digest(IDS, piece), len(piece) // 4), piece))
        at += len(piece)
    return out


def cut_text(text: str) -> list[tuple[Ref, bytes]]:
    """The blocks of a body: its segments, each with its UTF-8 bytes."""
    out = []
    for segment in segments(text):
        data = segment.encode("utf-8", "surrogatepass")
        out.append(((digest(TEXT, data), len(data)), data))
    return out


def join_text(pieces: Iterable[bytes]) -> str:
    return b"".join(pieces).decode("utf-8", "surrogatepass")


# A JSON string (escapes included) or one structural character: the scanner's tokens.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\],:]')
_LISTS = ('"messages"', '"input"')  # chat and Messages, Responses


def segments(text: str) -> list[str]:
    """``text`` cut at the messages of its top-level ``messages`` (or ``input``) list;
    the pieces join back to ``text`` exactly. Text that is not such JSON is one piece."""
    cuts = _message_cuts(text)
    if not cuts:
        return [text] if text else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in pairwise(bounds) if b > a]


def _message_cuts(text: str) -> list[int]:
    """Where the list's first element region starts (after ``[``) and where each of its
    elements ends; [] when there is no such list of objects."""
    tokens = _tokens(text)
    depth, key, previous = 0, None, None
    for match in tokens:
        token = match.group()
        if token in "{[":
            depth += 1
            if depth == 2 and token == "[" and previous == ":" and key in _LISTS:
                return _elements(tokens, match.end())
        elif token in "}]":
            depth -= 1
        elif depth == 1 and token[0] == '"' and previous in ("{", ","):
            key = token
        previous = token
    return []


def _elements(tokens: Iterator[re.Match], start: int) -> list[int]:
    cuts, depth, expect_object = [start], 0, True
    for match in tokens:
        token = match.group()
        if depth == 0:
            if token == "]":
                return cuts
            if token == ",":
                expect_object = True
                continue
            if token != "{" or not expect_object:
                return []  # an element that is not an object: keep the body whole
            expect_object = False
        if token in "{[":
            depth += 1
        elif token in "}]":
            depth -= 1
            if depth == 0:
                cuts.append(match.end())
    return []


def _tokens(text: str) -> Iterator[re.Match]:
    return _TOKEN.finditer(text)
