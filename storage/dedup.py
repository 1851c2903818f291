"""The writer's half of "each token stored once": a batch of records → references + the
blocks the database does not hold yet.

Runs in the writer, off the request path, inside the batch's transaction. For each
conversation (episode) it remembers the references of the last call it committed
(``BlockCache``, bounded): the next call's prompt is cut at the same boundaries, so the
shared prefix names the same blocks, and those blocks (and the request's resent
messages) need not be packed or sent again. A conversation it does not remember (a
restart, another worker wrote its last call) is looked up in the database once. Blocks
are content-addressed and inserted ``ON CONFLICT DO NOTHING``: GRPO samples that share a
first prompt share its blocks whoever wrote them first.

The cache is only updated after the batch commits (``BlockCache.commit``): a batch that
fails leaves it as it was, so no later call can reference a block that was never stored.
It is dropped whole when ``tracetap prune`` has swept blocks since (storage.retention).
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from tracetap.storage.blocks import (
    FLOATS,
    IDS,
    TEXT,
    Ref,
    cut_ids,
    cut_text,
    pack_block,
    pack_refs,
    unpack_refs,
    whole,
)
from tracetap.storage.codec import pack_ids, pack_logprobs
from tracetap.storage.conversation import Readers
from tracetap.storage.experts import EXPERTS
from tracetap.storage.prefix import Prefix
from tracetap.storage.records import CallRecord

# The bodies stored as references, by record field (and calls column "<field>_refs").
BODIES = ("request", "upstream_request", "response")


class Last(msgspec.Struct, gc=False):
    """What the next call of a conversation reuses: its prompt's blocks, and every block
    hash the call referenced (known stored). Fresh from this process's own writes, also
    the prompt's ids and its bodies' prefixes (storage.prefix.Prefix): the next call is
    then compared with them byte for byte and only its new part is hashed, and its
    choices' completion ids (``answers``: the next prompt resends one, which is cut as the
    block the choice stored, storage.blocks.cut_ids); read back from the database, only
    the references (the next call hashes what it resends)."""

    prompt: list[Ref]
    known: frozenset[bytes]
    ids: bytes | None = None
    texts: dict[str, Prefix] = {}
    answers: tuple[bytes, ...] = ()

    @property
    def size(self) -> int:
        """Bytes (about) of the content this entry keeps."""
        return (len(self.ids or b"") + sum(prefix.size for prefix in self.texts.values())
                + sum(map(len, self.answers)))


class Planned(msgspec.Struct, gc=False):
    """One record's references (calls columns; choices columns by choice index) and the
    last-call entry it leaves."""

    refs: dict[str, bytes | None]
    choices: dict[int, dict[str, bytes | None]]
    last: Last | None


class Plan(msgspec.Struct, gc=False):
    calls: dict[str, Planned]  # by call_id
    blocks: dict[bytes, bytes]  # hash → stored bytes, for blocks to insert
    episodes: dict[str, Last]  # the last call of each conversation after this batch


class BlockCache:
    """The last committed call of each recent conversation, least recently used out past
    ``conversations`` or past ``content_bytes`` of kept prompts and bodies (about 11 bytes
    per token of context of the conversations in flight; an image costs its entry, not
    its base64: storage.prefix)."""

    def __init__(self, conversations: int = 2048, content_bytes: int = 64 << 20):
        self.conversations = conversations
        self.content_bytes = content_bytes
        self.swept: int | None = None  # the prune sweep serial this cache is valid for
        self._last: OrderedDict[str, Last] = OrderedDict()
        self._size = 0

    def get(self, episode_id: str) -> Last | None:
        last = self._last.get(episode_id)
        if last is not None:
            self._last.move_to_end(episode_id)
        return last

    def valid_for(self, swept: int) -> None:
        """Forget everything if blocks were swept since this cache was filled."""
        if swept != self.swept:
            self._last.clear()
            self._size = 0
            self.swept = swept

    def commit(self, plan: Plan) -> None:
        for episode_id, last in plan.episodes.items():
            old = self._last.pop(episode_id, None)
            self._size += last.size - (old.size if old is not None else 0)
            self._last[episode_id] = last
        while self._last and (len(self._last) > self.conversations
                              or self._size > self.content_bytes):
            self._size -= self._last.popitem(last=False)[1].size


def plan(records: list[CallRecord], parents: dict[str, Last],
         readers: Readers | None = None) -> Plan:
    """References for ``records`` (in the order given: a conversation's calls in arrival
    order) given the last stored call of their conversations. ``readers``: each API's
    request shape, by endpoint (storage.conversation): a request is cut at its messages;
    without it (or for an API without a shape) every body is one block."""
    shapes = Readers() if readers is None else readers
    out = Plan(calls={}, blocks={}, episodes={})
    for record in records:
        last = out.episodes.get(record.episode_id) or parents.get(record.episode_id)
        known = last.known if last is not None else frozenset()
        used: set[bytes] = set()
        ids = packed_prompt(record)
        prompt = _cut_prompt(ids, last, known, used, out.blocks)
        refs: dict[str, bytes | None] = {
            "prompt_refs": None if ids is None else pack_refs(prompt)}
        texts = _cut_bodies(record, shapes, last, known, used, out.blocks, refs)
        answers: list[bytes] = []
        choices = _choices(record, out.blocks, answers)
        entry = None
        if record.episode_id is not None:
            used.update(whole(IDS, a)[0][0] for a in answers)  # stored with this call
            entry = _next_last(prompt, ids, texts, last, used, tuple(answers))
            out.episodes[record.episode_id] = entry
        out.calls[record.call_id] = Planned(refs=refs, choices=choices, last=entry)
    return out


def _cut_prompt(ids: bytes | None, last: Last | None, known: frozenset[bytes],
                used: set[bytes], blocks: dict[bytes, bytes]) -> list[Ref]:
    """The prompt's blocks, continuing the boundaries of the conversation's last prompt."""
    if ids is None:
        return []
    pieces = cut_ids(ids, last.prompt if last else None, last.ids if last else None,
                     last.answers if last else ())
    _add(blocks, pieces, known, used, IDS)
    return [ref for ref, _ in pieces]


def _cut_bodies(record: CallRecord, shapes: Readers, last: Last | None,
                known: frozenset[bytes], used: set[bytes], blocks: dict[bytes, bytes],
                refs: dict[str, bytes | None]) -> dict[str, Prefix]:
    """Each body's references into ``refs``; the message prefixes the next call may share.
    The request is the client's, ``upstream_request`` the upstream's (a translated call's
    endpoint names both); a reply is never cut."""
    lists = {"request": shapes.shape(record.endpoint).messages,
             "upstream_request": shapes.upstream_shape(record.endpoint).messages}
    texts: dict[str, Prefix] = {}
    for field in BODIES:
        text = getattr(record, field)
        if text is None:
            refs[field + "_refs"] = None
            continue
        pieces, prefix = cut_text(text, lists.get(field),
                                  last.texts.get(field) if last else None)
        if prefix is not None:
            texts[field] = prefix
        _add(blocks, pieces, known, used, TEXT)
        refs[field + "_refs"] = pack_refs(ref for ref, _ in pieces)
    return texts


def _next_last(prompt: list[Ref], ids: bytes | None, texts: dict[str, Prefix],
               last: Last | None, used: set[bytes], answers: tuple[bytes, ...]) -> Last:
    """What the conversation's next call continues from after this one."""
    if ids is None and last is not None:  # a call without ids (an error): the next
        prompt, ids = last.prompt, last.ids  # one continues the last prompt seen
        answers = answers or last.answers
        used.update(h for h, _ in prompt)
    if last is not None:
        texts = {**last.texts, **texts}
        used.update(h for prefix in last.texts.values() for h, _ in prefix.refs)
    return Last(prompt=prompt, known=frozenset(used), ids=ids, texts=texts, answers=answers)


def packed_prompt(record: CallRecord) -> bytes | None:
    """The record's prompt ids as stored bytes: packed by the proxy already, when it did."""
    if record.prompt_ids_packed is not None:
        return record.prompt_ids_packed
    return pack_ids(record.prompt_ids)


def _choices(record: CallRecord, blocks: dict[bytes, bytes],
             answers: list[bytes]) -> dict[int, dict]:
    """Each choice's text, ids and logprobs as one block each, compressed; into
    ``answers``, each choice's completion ids (int32 bytes)."""
    out = {}
    for choice in record.choices:
        refs: dict[str, bytes | None] = {}
        for column, kind, data in (
                ("text_refs", TEXT, None if choice.text is None
                 else choice.text.encode("utf-8", "surrogatepass")),
                ("completion_ids_refs", IDS, pack_ids(choice.completion_ids)),
                ("completion_logprobs_refs", FLOATS, pack_logprobs(choice.completion_logprobs)),
                ("routed_experts_refs", EXPERTS, choice.routed_experts)):
            if data is None:
                refs[column] = None
                continue
            if kind == IDS:
                answers.append(data)
            ref, _ = whole(kind, data)
            if ref[0] not in blocks:
                blocks[ref[0]] = pack_block(data, kind)
            refs[column] = pack_refs([ref])
        out[choice.index] = refs
    return out


def _add(blocks: dict[bytes, bytes], pieces, known: frozenset[bytes], used: set[bytes],
         kind: bytes) -> None:
    for (h, _), data in pieces:  # data is None only for a block of the last call: known
        used.add(h)
        if h not in known and h not in blocks:
            blocks[h] = pack_block(data, kind)


def last_of(prompt_refs: bytes | None, body_refs: list[bytes | None]) -> Last:
    """A conversation's last call as read back from the database."""
    prompt = unpack_refs(prompt_refs) if prompt_refs is not None else []
    known = {h for h, _ in prompt}
    for refs in body_refs:
        if refs is not None:
            known.update(h for h, _ in unpack_refs(refs))
    return Last(prompt=prompt, known=frozenset(known))

