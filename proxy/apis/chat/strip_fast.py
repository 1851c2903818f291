"""A stream chunk cut by byte ranges: ``strip_chunk``'s bytes, without its decode and
re-encode, and what capture reads of it, in one msgspec call, for the one shape engines
stream token after token.

``strip_chunk`` decodes a chunk's top level and its choices and encodes both again, so
what the client gets is the upstream's bytes with the proxy's fields taken out and those
two levels written compactly. For a chunk already written compactly that is a cut of the
upstream's bytes, which is what this module makes, when it can prove the chunk is

    HEAD D },"logprobs":{ L FINISH [STOP] [,"token_ids": IDS] }] [,"usage":null] }

where HEAD (``{"id":…,"choices":[{"index":0,"delta":{``) is the stream's own head,
checked against ``strip_chunk``'s decode once (``learn``) and then matched as bytes, and
``{D}``, ``{L}`` and IDS are each one JSON value: one msgspec call decodes the three as
capture's own Structs (``Message``, ``ChatLogprobs``, ``list[int]``), which both proves
it and gives capture the chunk. The model's text is in D and L only, as JSON strings: it
can write ``},"logprobs":{`` only escaped (``\\"``), so the last plain one before FINISH
is a key, and decoding ``{D}`` and ``{L}`` as whole values proves it is the choice's.

Anything else (several choices, other keys or order, whitespace between members, the
usage or ``sglext`` chunk, MoE routing asked for, a head not yet checked) goes through
``strip_chunk`` and ``Capture.add``: this is only ever a faster way to the same bytes and
the same capture.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import msgspec

from tracetap.proxy.apis import Injected
from tracetap.proxy.apis.chat.wire import ChatBody, ChatLogprobs, Message

# The choice's members after its logprobs, as engines write them (vLLM, SGLang, the proxy's
# own continuation chunks), with the finish reason each one means; any other ending takes
# the exact path.
_FINISH_NULL = b'},"finish_reason":null'  # from the logprobs' closing brace
_FINISH = ((_FINISH_NULL, None), (b'},"finish_reason":"length"', "length"),
           (b'},"finish_reason":"stop"', "stop"), (b'},"finish_reason":"tool_calls"', "tool_calls"))
_STOP = (b',"stop_reason":null', b',"matched_stop":null')
_LOGPROBS = b'},"logprobs":{'
_IDS = b',"token_ids":['
_VLLM_TAIL = _FINISH_NULL + _IDS
_VALUE_AT = len(_LOGPROBS) - 1  # from a _LOGPROBS found: where the logprobs' "{" is
_IDS_AT = len(_IDS) - 1  # from an _IDS found: where the ids' "[" is
_VLLM_IDS = len(_VLLM_TAIL) - 1  # from a _VLLM_TAIL found: where the ids' "[" is
_USAGE_NULL = b',"usage":null}'
_USAGE_AT = len(_USAGE_NULL) + 2  # from the end: where "}]" is, before the usage member
# Top-level keys a head may hold: none of them is one strip_chunk takes out.
_HEAD_KEYS = frozenset(("id", "object", "created", "model", "system_fingerprint",
                        "service_tier"))

_with_ids = msgspec.json.Decoder(tuple[Message, ChatLogprobs, list[int]]).decode
_without_ids = msgspec.json.Decoder(tuple[Message, ChatLogprobs]).decode
_decode_top = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode_choices = msgspec.json.Decoder(list[dict[str, msgspec.Raw]]).decode


# Where a cut chunk's choice parts go: (delta, logprobs, token ids, finish reason).
Add = Callable[[Message, ChatLogprobs, "list[int] | None", "str | None"], None]


def _nowhere(delta: Message, logprobs: ChatLogprobs, ids: list[int] | None,
             finish: str | None) -> None:
    """No capture to give the parts to (a cutter that only cuts)."""


class Head(NamedTuple):
    """A stream's head as bytes, and what capture reads of it."""

    raw: bytes
    body: ChatBody  # the chunk it was learned from (id, model, created, the choice's index)


class ChunkCutter:
    """One stream's chunks of the usual shape, cut (``cut``) once its head is known."""

    __slots__ = ("_at", "_drop_ids", "_null_logprobs", "_raw", "_usage", "_vllm_rest", "add",
                 "head")

    def __init__(self, injected: Injected, add: Add = _nowhere):
        self.add = add  # given each cut chunk's choice parts (Capture.delta_adder)
        self._null_logprobs = injected.logprobs
        self._drop_ids = injected.token_ids or injected.sglext
        self._usage = injected.usage
        # What follows vLLM's logprobs when its ids go: the finish reason alone.
        self._vllm_rest = _FINISH_NULL[1:] if self._drop_ids else b""
        self.head: Head | None = None
        self._raw, self._at = b"\0", 0  # the head's bytes (none starts so), their length

    def cut(self, data: bytes) -> bytes | None:
        """``data`` stripped, as the client's SSE event, its choice's parts given to
        ``add``; or None where it is not of the shape (module doc), nothing given. Each
        step is one C call: on the usual chunk, the Python between them is the cost."""
        if not data.startswith(self._raw):
            return None
        at = self._at
        tail = data.rfind(_VLLM_TAIL, at) if data.endswith(b"]}]}") else -1
        if tail < 0:
            return self._cut_other(data, at)
        # vLLM's token chunk, HEAD D},"logprobs":{L},"finish_reason":null,"token_ids":[IDS]}]}
        # (tail: at L's closing brace): one search found the ids and the logprobs' end.
        lp = data.rfind(_LOGPROBS, at, tail)
        if lp < 0:
            return None
        value_at = lp + _VALUE_AT
        logprobs = data[value_at:tail + 1]
        try:  # each piece one JSON value, capture's Structs; nothing around them (each
            # starts and ends with its bracket: the literals hold them)
            delta, found, ids = _with_ids(b"".join((b"[", data[at - 1:lp + 1], b",", logprobs,
                                                    b",", data[tail + _VLLM_IDS:-3], b"]")))
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        self.add(delta, found, ids, None)
        return b"".join((b"data: ", data[:value_at], b"null" if self._null_logprobs else logprobs,
                         self._vllm_rest or data[tail + 1:-3], b"}]}\n\n"))

    def _cut_other(self, data: bytes, at: int) -> bytes | None:
        """``cut`` for the shape's other endings: a finish reason, a stop member, no ids
        (SGLang), the usage member (module doc)."""
        usage = data.endswith(_USAGE_NULL)
        end = len(data) - (_USAGE_AT if usage else 3)  # just past the choice's last member
        if not data.startswith(b"}]", end):
            return None
        ids = data.rfind(_IDS, at, end)
        if ids >= 0 and data[end - 1] != 0x5D:  # "]": no space after the ids
            return None
        lp_end, finish = _finish_start(data, at, end if ids < 0 else ids)
        lp = data.rfind(_LOGPROBS, at, lp_end) if lp_end > 0 else -1
        if lp < 0:
            return None
        value_at = lp + _VALUE_AT
        logprobs = data[value_at:lp_end]
        try:
            if ids < 0:
                delta, found, token_ids = *_without_ids(
                    b"".join((b"[", data[at - 1:lp + 1], b",", logprobs, b"]"))), None
            else:
                delta, found, token_ids = _with_ids(b"".join(
                    (b"[", data[at - 1:lp + 1], b",", logprobs, b",", data[ids + _IDS_AT:end],
                     b"]")))
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        self.add(delta, found, token_ids, finish)
        return b"".join((b"data: ", data[:value_at], b"null" if self._null_logprobs else logprobs,
                         data[lp_end:ids if ids >= 0 and self._drop_ids else end],
                         b"}]}" if usage and self._usage else data[end:], b"\n\n"))

    def learn(self, data: bytes) -> None:
        """Take ``data``'s head as the stream's where ``strip_chunk`` writes it as it came
        and capture read it whole (the caller says so by calling)."""
        raw = learn(data)
        if raw is not None:
            try:
                body = msgspec.json.decode(data, type=ChatBody)
            except (msgspec.DecodeError, msgspec.ValidationError):
                return
            self.head = Head(raw, body)
            self._raw, self._at = raw, len(raw)


def _finish_start(data: bytes, at: int, stop: int) -> tuple[int, str | None]:
    """Where the choice's logprobs end, and its finish reason, on the chunks that end a
    choice (SGLang's or vLLM's stop may follow the reason); -1 for any other ending."""
    for tail in _STOP:
        if data.endswith(tail, at, stop):
            stop -= len(tail)
            break
    for literal, reason in _FINISH:
        if data.endswith(literal, at, stop):
            return stop - len(literal) + 1, reason
    return -1, None


def learn(data: bytes) -> bytes | None:
    """The head of ``data`` (up to its first choice's ``"delta":{``) where its bytes are
    exactly what ``strip_chunk`` would write for it: known plain keys, no whitespace, no
    key twice, the choice's ``index`` first and an object ``delta`` next; else None."""
    if data.find(b'"choices":[{"index":') < 0:
        return None
    try:
        top = _decode_top(data)
        choices = _decode_choices(top["choices"]) if "choices" in top else []
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if len(choices) != 1 or list(choices[0])[:2] != ["index", "delta"]:
        return None
    pieces = [b"{"]
    for key, value in top.items():
        if key == "choices":
            break
        if key not in _HEAD_KEYS:
            return None
        pieces += (b'"', key.encode(), b'":', bytes(value), b",")
    pieces += (b'"choices":[{"index":', bytes(choices[0]["index"]), b',"delta":{')
    head = b"".join(pieces)
    return head if data.startswith(head) else None
