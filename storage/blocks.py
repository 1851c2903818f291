"""Content-addressed blocks: how a prompt's ids and a request's text are cut, named, packed.

A call stores its prompt ids and its bodies as *references*: a list of (hash, length)
entries naming blocks in the ``blocks`` table, which holds each distinct block once.
Prompt ids are cut into blocks of ``BLOCK_TOKENS`` ids, continuing the boundaries of the
previous call of the same conversation (so the prefix it shares names the same blocks and
only the new tokens make new ones); a conversation's first call is cut from position 0,
so the samples of a GRPO group, which share it, share its blocks. A request is cut at its
messages (``segments``), the list under the key its API's shape names
(storage.conversation.Shape: ``messages``, ``input``, ...): the JSON before the first
message, each message with the separator before it, and the rest; a message resent in
every later turn is stored once.
An image's base64 inside a segment is a block of its own, stored as its bytes
(storage.images): one block per image, whatever JSON shape holds it.
Pure functions: no database here (storage.dedup plans, storage.inflate reads).
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct
from collections.abc import Iterable, Iterator
from itertools import pairwise

import msgspec

from tracetap.storage import images
from tracetap.storage.images import IMAGE, Base64Text
from tracetap.storage.prefix import Piece, Prefix, merged, piece

HASH_BYTES = 16
_ENTRY = struct.Struct("<16sI")  # a reference: the block's hash, its length
ENTRY_BYTES = _ENTRY.size
# Ids per prompt block: a conversation's first call is cut finely, so that prompts that
# share only their start (a system prompt) share most of it; its later calls add their
# new tokens in large blocks (fewer rows, and short reference lists: 20 bytes a block).
FIRST_BLOCK_TOKENS = 256
BLOCK_TOKENS = 2048
# What a block holds (part of its hash: never confused): int32 ids, float64 logprobs, text.
IDS, FLOATS, TEXT = b"ids", b"f64", b"text"
_WIDTH = {IDS: 4, FLOATS: 8}  # bytes per value; a reference's length counts values
# The first byte of a stored block says how the rest is packed: as it is; zstd; zstd of
# 4- or 8-byte values regrouped byte plane by byte plane (all first bytes, then all second
# bytes, ...: the high planes of token ids and of logprobs are nearly constant and shrink
# to almost nothing).
# Logprobs have a third way, whichever is smaller: zstd of their shortest decimal forms
# (what the engine's JSON said: a few digits each, where the float's low bytes are noise).
_RAW, _ZSTD, _ZSTD_PLANES4, _ZSTD_PLANES8, _ZSTD_DECIMAL = 0, 1, 2, 3, 4
# An image payload (storage.images): the bytes its base64 text encodes, as they are
# (pictures are compressed already); read back as the text.
_IMAGE = images.FORM
_PLANES = {_ZSTD_PLANES4: 4, _ZSTD_PLANES8: 8}
_MIN_COMPRESS = 64  # bytes; below, the codec's header costs more than it saves
# zstd at level 1: as small as zlib's best at a twentieth of its CPU (the writer's CPU is
# the proxy's). pyarrow ships it; tracetap depends on pyarrow for its export anyway.
# Loaded on first use, so the command line starts without pyarrow; the writer loads it when
# it starts (Writer.start), before any call, so no call waits for the import.


@functools.cache
def codec():
    import pyarrow

    return pyarrow.Codec("zstd", 1)


Ref = tuple[bytes, int]  # (hash, length: ids for IDS blocks, UTF-8 bytes for TEXT)


def digest(kind: bytes, data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=HASH_BYTES, person=kind).digest()


def pack_refs(refs: Iterable[Ref]) -> bytes:
    return b"".join(_ENTRY.pack(h, n) for h, n in refs)


def unpack_refs(data: bytes) -> list[Ref]:
    return list(_ENTRY.iter_unpack(bytes(data)))


def refs_length(data: bytes) -> int:
    """The total length the references name (ids of a prompt, logprobs of a choice, bytes
    of a text) without reading a block."""
    return sum(n for _, n in _ENTRY.iter_unpack(bytes(data)))


def pack_block(data: bytes, kind: bytes = TEXT) -> bytes:
    """A block as stored: compressed (after its format byte and its size, uint32) when
    that is smaller, else as it is (after its format byte)."""
    if isinstance(data, Base64Text):
        return bytes((_IMAGE,)) + data.raw
    if len(data) >= _MIN_COMPRESS:
        width = _WIDTH.get(kind, 1) if len(data) % _WIDTH.get(kind, 1) == 0 else 1
        form = {1: _ZSTD, 4: _ZSTD_PLANES4, 8: _ZSTD_PLANES8}[width]
        packed = codec().compress(_planes(data, width), asbytes=True)
        size = len(data)  # what the payload decompresses to
        decimal = _decimal(data) if width == 8 else None
        if decimal is not None:
            shorter = codec().compress(decimal, asbytes=True)
            if len(shorter) < len(packed):
                form, packed, size = _ZSTD_DECIMAL, shorter, len(decimal)
        if len(packed) + 4 < len(data):
            return bytes((form,)) + size.to_bytes(4, "little") + packed
    return bytes((_RAW,)) + data


def unpack_block(stored: bytes) -> bytes:
    stored = bytes(stored)
    form = stored[0]
    if form == _RAW:
        return stored[1:]
    if form == _IMAGE:
        return images.encoded(stored[1:])
    if form != _ZSTD and form != _ZSTD_DECIMAL and form not in _PLANES:
        raise ValueError(f"unknown block format {form}")
    size = int.from_bytes(stored[1:5], "little")
    data = codec().decompress(stored[5:], decompressed_size=size, asbytes=True)
    if form == _ZSTD_DECIMAL:
        return _floats(data)
    return _unplanes(data, _PLANES.get(form, 1))


def _decimal(data: bytes) -> bytes | None:
    """float64s as their shortest decimal forms, comma-separated; None when one has no
    such form (an infinity or a NaN: msgspec writes them as ``null``).

    msgspec writes the shortest form that reads back as the very same float, in C: the
    repr-and-check it replaced cost ~180 µs for a 400-token choice, most of the writer's
    CPU for a streamed turn's logprobs."""
    text = _encode_floats(struct.unpack(f"<{len(data) // 8}d", data))
    return None if b"null" in text else text[1:-1]


def _floats(text: bytes) -> bytes:
    try:
        values = _decode_floats(b"[" + text + b"]")
    except msgspec.DecodeError:  # a block written before msgspec wrote them: "inf", "nan"
        values = [float(v) for v in text.split(b",")]
    return struct.pack(f"<{len(values)}d", *values)


_encode_floats = msgspec.json.encode
_decode_floats = msgspec.json.Decoder(list[float]).decode


def _planes(data: bytes, width: int) -> bytes:
    return data if width == 1 else b"".join(data[k::width] for k in range(width))


def _unplanes(data: bytes, width: int) -> bytes:
    if width == 1:
        return data
    n = len(data) // width
    out = bytearray(len(data))
    for k in range(width):
        out[k::width] = data[k * n:(k + 1) * n]
    return bytes(out)


def whole(kind: bytes, data: bytes) -> tuple[Ref, bytes]:
    """``data`` as one block (a choice's text, ids or logprobs: never shared, so never
    cut), with its reference."""
    return (digest(kind, data), len(data) // _WIDTH.get(kind, 1)), data


def cut_ids(ids: bytes, parent: list[Ref] | None,
            parent_ids: bytes | None = None,
            answers: tuple[bytes, ...] = ()) -> list[tuple[Ref, bytes]]:
    """The blocks of a prompt (int32 bytes): the parent's boundaries as far as its blocks
    recur, then ``BLOCK_TOKENS`` at a time (``FIRST_BLOCK_TOKENS`` without a parent).
    Each block comes with its bytes. With the parent's ids at hand, a recurring block is
    recognised by comparing bytes, not by hashing them again. ``answers``: the parent's
    completions (int32 bytes); one found whole where the parent's prompt ends (give or
    take a chat template's few tokens) is a block of its own, the very block its choice
    stored (``whole``), so the answer a conversation resends is stored once."""
    out: list[tuple[Ref, bytes]] = []
    at = 0
    for h, n in parent or ():
        end = at + 4 * n
        if end > len(ids):
            break
        piece = ids[at:end]
        if parent_ids is not None and len(parent_ids) >= end:
            if piece != parent_ids[at:end]:
                break
        elif digest(IDS, piece) != h:
            break
        out.append(((h, n), piece))
        at = end
    step = 4 * (BLOCK_TOKENS if out else FIRST_BLOCK_TOKENS)
    found = _answer_at(ids, at, answers) if out else None
    if found is not None:
        start, answer = found
        _cut_new(ids, at, start, step, out)
        out.append(whole(IDS, answer))
        at = start + len(answer)
    _cut_new(ids, at, len(ids), step, out)
    return out


ANSWER_SLACK = 64  # ids a chat template may put between a prompt's end and its answer
MIN_ANSWER = 16  # ids: a shorter answer is not worth a block (a reference costs 20 bytes)


def _answer_at(ids: bytes, at: int, answers: tuple[bytes, ...]) -> tuple[int, bytes] | None:
    """(where, answer) for the first of ``answers`` that ``ids`` holds whole, starting
    within ANSWER_SLACK ids of ``at``; None if none does."""
    for answer in answers:
        if len(answer) < 4 * MIN_ANSWER:
            continue
        limit = min(len(ids), at + 4 * ANSWER_SLACK + len(answer))
        start = ids.find(answer, at, limit)
        while start >= 0 and start % 4:  # a match must start at an id
            start = ids.find(answer, start + 1, limit)
        if start >= 0:
            return start, answer
    return None


def _cut_new(ids: bytes, at: int, end: int, step: int,
             out: list[tuple[Ref, bytes]]) -> None:
    while at < end:
        piece = ids[at:min(at + step, end)]
        out.append(((digest(IDS, piece), len(piece) // 4), piece))
        at += len(piece)


# A body's messages as far as they go (everything but what follows the last message) and
# their references: what the next call of the conversation resends first (storage.prefix:
# its text, its images by their hash).


def cut_text(text: str, messages: str | None, previous: Prefix | None = None,
             ) -> tuple[list[tuple[Ref, bytes | None]], Prefix | None]:
    """The blocks of a body: its segments (one when there is no ``messages`` key to cut
    at: a reply, an API without a shape), each with its UTF-8 bytes; and its prefix (see
    Prefix) when it has messages.
    ``previous``: the last call's prefix; when this body starts with it, its blocks are
    reused as they are (bytes None) and only what follows is scanned and hashed."""
    if messages is None:
        return _named([text] if text else []), None
    if previous is not None and previous.starts(text):
        at = previous.length
        ends = _element_ends(_tokens(text, at), [], expect_object=False)
        if ends is not None:
            kept: list[list[Piece]] = []
            groups = _grouped([text[a:b] for a, b in pairwise([at, *ends, len(text)])], kept)
            prefix = previous.extended(_flat(kept[:-1]), _refs(groups[:-1])) if ends \
                else previous
            return [(r, None) for r in previous.refs] + _flat(groups), prefix
    cuts = _message_cuts(text, messages)
    if len(cuts) < 2:  # no message: one piece, nothing for the next call to reuse
        return _named(segments(text, messages)), None
    kept = []
    groups = _grouped([text[a:b] for a, b in pairwise([0, *cuts, len(text)])], kept)
    return _flat(groups), Prefix(merged(_flat(kept[:-1])), _refs(groups[:-1]))


def _named(segments: list[str]) -> list[tuple[Ref, bytes]]:
    return _flat(_grouped(segments))


def _grouped(segments: list[str], kept: list[list[Piece]] | None = None,
             ) -> list[list[tuple[Ref, bytes]]]:
    """Each segment's blocks: its text, with each image payload in it a block of its
    own (storage.images), named by the image's bytes; into ``kept``, each segment's
    pieces as a Prefix keeps them."""
    out = []
    for segment in segments:
        pieces = []
        split = images.split(segment)
        for part, raw in split:
            data = part.encode("utf-8", "surrogatepass")
            if raw is None:
                pieces.append(((digest(TEXT, data), len(data)), data))
            else:
                pieces.append(((digest(IMAGE, raw), len(data)), Base64Text(data, raw)))
        out.append(pieces)
        if kept is not None:
            kept.append([piece(part, raw is not None) for part, raw in split])
    return out


def _flat(groups: list[list[tuple[Ref, bytes]]]) -> list[tuple[Ref, bytes]]:
    return [piece for group in groups for piece in group]


def _refs(groups: list[list[tuple[Ref, bytes]]]) -> list[Ref]:
    return [ref for group in groups for ref, _ in group]


def join_text(pieces: Iterable[bytes]) -> str:
    return b"".join(pieces).decode("utf-8", "surrogatepass")


# The scanner's stops: a structural character or the quote opening a string; a string's
# contents are skipped with str.find (memchr speed), not character by character.
_STOP = re.compile(r'["{}\[\],:]')
# Messages cut into blocks of their own per body, at most: past it the rest of the body is
# one block. Bounds the rows one request makes (an agent's 5 MiB of tiny messages would
# otherwise be 170,000 blocks, each hashed, packed and inserted); a conversation adds its
# new messages each call, so a long one still shares all but the last call's tail.
MAX_CUT_ELEMENTS = 4096


def segments(text: str, messages: str) -> list[str]:
    """``text`` cut at the messages of its top-level list under the key ``messages``; the
    pieces join back to ``text`` exactly. Text that is not such JSON is one piece."""
    cuts = _message_cuts(text, messages)
    if not cuts:
        return [text] if text else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in pairwise(bounds) if b > a]


def _message_cuts(text: str, messages: str) -> list[int]:
    """Where the list's first element region starts (after ``[``) and where each of its
    elements ends; [] when there is no such list of objects. The key is compared as
    written (a key spelled with escapes, or over 30 characters, is not found)."""
    wanted = f'"{messages}"'
    tokens = _tokens(text)
    depth, key, previous = 0, None, None
    for token, _, end in tokens:
        if token in "{[":
            depth += 1
            if depth == 2 and token == "[" and previous == ":" and key == wanted:
                return _elements(tokens, end)
        elif token in "}]":
            depth -= 1
        elif depth == 1 and token[0] == '"' and previous in ("{", ","):
            key = token
        previous = token
    return []


def _elements(tokens: Iterator[tuple[str, int, int]], start: int) -> list[int]:
    return _element_ends(tokens, [start], expect_object=True) or []


def _element_ends(tokens: Iterator[tuple[str, int, int]], cuts: list[int], *,
                  expect_object: bool) -> list[int] | None:
    """``cuts`` and where each further element of the list ends, up to its ``]``; None
    when an element is not an object or the list does not end."""
    depth = 0
    for token, _, end in tokens:
        if depth == 0:
            if token == "]":
                return cuts
            if token == ",":
                expect_object = True
                continue
            if token != "{" or not expect_object:
                return None  # an element that is not an object: keep the body whole
            expect_object = False
        if token in "{[":
            depth += 1
        elif token in "}]":
            depth -= 1
            if depth == 0:
                cuts.append(end)
                if len(cuts) > MAX_CUT_ELEMENTS:
                    return cuts  # the rest, whatever it holds, is one block
    return None


def _tokens(text: str, at: int = 0) -> Iterator[tuple[str, int, int]]:
    """(token, start, end) from ``at``: structural characters, and strings (the token is
    the whole string only when it is short enough to be a key, else its opening quote)."""
    search, find = _STOP.search, text.find
    while (match := search(text, at)) is not None:
        start = match.start()
        if match.group() != '"':
            at = start + 1
            yield match.group(), start, at
            continue
        end = find('"', start + 1)
        while end > 0 and _escaped(text, end):
            end = find('"', end + 1)
        if end < 0:
            return  # an unterminated string: nothing more to cut
        at = end + 1
        yield (text[start:at] if at - start <= 32 else '"'), start, at


def _escaped(text: str, quote: int) -> bool:
    """Whether the quote at ``quote`` is escaped (an odd run of backslashes before it)."""
    run = quote - 1
    while text[run] == "\\":
        run -= 1
    return (quote - 1 - run) % 2 == 1
