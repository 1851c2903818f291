"""A stream chunk stripped by byte ranges: ``strip_chunk``'s bytes, without its decode
and re-encode, for the one shape engines stream token after token.

``strip_chunk`` decodes a chunk's top level and its choices and encodes both again, so
what the client gets is the upstream's bytes with the proxy's fields taken out and those
two levels written compactly. For a chunk already written compactly that is a cut of the
upstream's bytes, which is what this module makes, when it can prove the chunk is

    HEAD D ,"logprobs": L FINISH [STOP] [,"token_ids": IDS] }] [,"usage":null] }

where HEAD (``{"id":…,"choices":[{"index":0,"delta":``) is the stream's own head, checked
against ``strip_chunk``'s decode once (``learn``) and then matched as bytes, and D, L
and IDS are each one JSON value with nothing around them (one msgspec call checks the
three). The model's text is in D and L only, as JSON strings: it can write
``,"logprobs":`` only escaped (``\\"``), so the last plain ``,"logprobs":`` before
FINISH is a key, and checking D and L as whole values proves it is the choice's.

Anything else (several choices, other keys or order, whitespace between members, the
usage or ``sglext`` chunk, MoE routing asked for, a head not yet checked) goes through
``strip_chunk``: this is only ever a faster way to the same bytes.
"""

from __future__ import annotations

import msgspec

from tracetap.proxy.apis import Injected
from tracetap.proxy.apis.chat.inject import strip_chunk

# The choice's members after its logprobs, as engines write them (vLLM, SGLang, the proxy's
# own continuation chunks); a finish reason outside this list takes the exact path.
_FINISH = (b',"finish_reason":null', b',"finish_reason":"length"', b',"finish_reason":"stop"',
           b',"finish_reason":"tool_calls"')
_STOP = (b',"stop_reason":null', b',"matched_stop":null')
_LOGPROBS = b',"logprobs":'
_IDS = b',"token_ids":['
_USAGE_NULL = b',"usage":null}'
_HEAD_TRIES = 3  # chunks the head is looked for in before the stream keeps the exact path
# Top-level keys a head may hold: none of them is one strip_chunk takes out.
_HEAD_KEYS = frozenset(("id", "object", "created", "model", "system_fingerprint",
                        "service_tier"))

_values2 = msgspec.json.Decoder(tuple[msgspec.Raw, msgspec.Raw]).decode
_values3 = msgspec.json.Decoder(tuple[msgspec.Raw, msgspec.Raw, msgspec.Raw]).decode
_decode_top = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode_choices = msgspec.json.Decoder(list[dict[str, msgspec.Raw]]).decode


class ChunkStripper:
    """One stream's chunks without what the proxy added (``strip``); learns the stream's
    head from the first chunks that take the exact path."""

    __slots__ = ("_drop_ids", "_head", "_injected", "_null_logprobs", "_tries", "_usage")

    def __init__(self, injected: Injected):
        self._injected = injected
        self._null_logprobs = injected.logprobs
        self._drop_ids = injected.token_ids or injected.sglext
        self._usage = injected.usage
        self._head: bytes | None = None
        # Routing asked for is in other keys than the shape's: every chunk is exact.
        self._tries = 0 if injected.experts else _HEAD_TRIES

    def strip(self, data: bytes) -> bytes | None:
        """``strip_chunk(data, injected)``: the same bytes, or the same exception."""
        head = self._head
        if head is not None and data.startswith(head):
            out = self._cut(data, len(head))
            if out is not None:
                return out
        out = strip_chunk(data, self._injected)
        if self._tries and head is None:
            self._tries -= 1
            self._head = learn(data)
        return out

    def _cut(self, data: bytes, at: int) -> bytes | None:
        """The stripped chunk, or None where ``data`` is not of the shape (module doc)."""
        end = len(data) - 1  # the top level's closing brace
        usage = data.endswith(_USAGE_NULL)
        if usage:
            end -= len(_USAGE_NULL) - 1
        if not data.startswith(b"}]", end - 2):
            return None
        end -= 2  # just past the choice's last member
        ids = data.rfind(_IDS, at, end) if data[end - 1] == 0x5D else -1  # "]"
        stop = ids if ids >= 0 else end
        for tail in _STOP:
            if data.endswith(tail, at, stop):
                stop -= len(tail)
                break
        for finish in _FINISH:
            if data.endswith(finish, at, stop):
                lp_end = stop - len(finish)
                break
        else:
            return None
        lp = data.rfind(_LOGPROBS, at, lp_end)
        if lp < 0:
            return None
        delta, logprobs = data[at:lp], data[lp + len(_LOGPROBS):lp_end]
        if not _single_values(delta, logprobs, data[ids + len(_IDS) - 1:end] if ids >= 0 else None):
            return None
        pieces = [data[:lp + len(_LOGPROBS)], b"null" if self._null_logprobs else logprobs,
                  data[lp_end:ids if ids >= 0 else end]]
        if ids >= 0 and not self._drop_ids:
            pieces.append(data[ids:end])
        pieces.append(b"}]}" if usage and self._usage else data[end:])
        return b"".join(pieces)


def _single_values(delta: bytes, logprobs: bytes, ids: bytes | None) -> bool:
    """Whether each piece is exactly one JSON value, nothing before or after it (one
    msgspec call: a piece holding a comma at its top would make the array longer)."""
    try:
        if ids is None:
            found = _values2(b"[" + delta + b"," + logprobs + b"]")
            return len(found[0]) + len(found[1]) == len(delta) + len(logprobs)
        found = _values3(b"[" + delta + b"," + logprobs + b"," + ids + b"]")
        return (len(found[0]) + len(found[1]) + len(found[2])
                == len(delta) + len(logprobs) + len(ids))
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False


def learn(data: bytes) -> bytes | None:
    """The head of ``data`` (up to its first choice's ``"delta":``) where its bytes are
    exactly what ``strip_chunk`` would write for it: plain keys, no whitespace, no key
    twice, the choice's ``index`` first and ``delta`` next; else None."""
    at = data.find(b'"choices":[{"index":')
    if at < 0:
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
    pieces += (b'"choices":[{"index":', bytes(choices[0]["index"]), b',"delta":')
    head = b"".join(pieces)
    return head if data.startswith(head) else None
