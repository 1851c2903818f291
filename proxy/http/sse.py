"""Incremental Server-Sent Events parser: bytes in, complete events out."""

from __future__ import annotations

import functools
import re
from itertools import repeat
from typing import NamedTuple

# No optional first character: the regex engine can then scan for "\n" quickly.
_BOUNDARY = re.compile(rb"\n\r?\n")


class Event(NamedTuple):
    raw: bytes  # the event exactly as received, boundary included
    data: bytes | None  # joined ``data:`` lines; None for comments and non-data events


# ``Event((raw, data))`` without the NamedTuple's Python-level ``__new__``: the parser
# makes one per streamed token.
_event = functools.partial(tuple.__new__, Event)


class SSEParser:
    """Splits a byte stream into events; survives events split across reads."""

    def __init__(self, max_event_bytes: int = 16 << 20):
        self.max_event_bytes = max_event_bytes
        self._buffer = bytearray()
        self.oversized = 0

    def feed(self, chunk: bytes) -> list[Event]:
        buffer = self._buffer
        if not buffer and b"\r" not in chunk:
            # A streaming engine's usual read: one whole one-line event, relayed and
            # parsed without a copy (the read is the event's raw bytes).
            if chunk.endswith(b"\n\n") and chunk.startswith(b"data: ") \
                    and chunk.count(b"\n") == 2:
                return [_event((chunk, chunk[6:-2]))]
            return self._feed_lf(chunk)
        start = max(0, len(buffer) - 2)  # a boundary may straddle two reads
        buffer += chunk
        events = []
        consumed = 0
        for match in _BOUNDARY.finditer(buffer, start):
            if match.start() < consumed:
                continue
            raw = bytes(buffer[consumed : match.end()])
            events.append(Event(raw, _data(raw)))
            consumed = match.end()
        del buffer[:consumed]
        if len(buffer) > self.max_event_bytes:
            # Never grow without bound on a stream that has no boundaries.
            self.oversized += 1
            events.append(Event(bytes(buffer), None))
            buffer.clear()
        return events

    def _feed_lf(self, chunk: bytes) -> list[Event]:
        """The usual read: nothing buffered, LF line ends (what engines send). Splitting on
        the boundary finds the same events as the regex, without copying the buffer."""
        lines = chunk.split(b"\n")  # one byte: a faster split than on the two
        if len(lines) % 2 and not lines[-1] and not any(lines[1::2]):
            data_lines = lines[0:-1:2]  # each line followed by one blank line: whole events
            if all(map(bytes.startswith, data_lines, repeat(b"data: "))):
                return [_event((line + b"\n\n", line[6:])) for line in data_lines]
        *whole, rest = chunk.split(b"\n\n")
        events = []
        for part in whole:
            if part.startswith(b"data: ") and b"\n" not in part:  # the usual one-line event
                events.append(Event(part + b"\n\n", part[6:]))
            else:
                raw = part + b"\n\n"
                events.append(Event(raw, _data(raw)))
        if rest:
            self._buffer += rest
            if len(rest) > self.max_event_bytes:
                self.oversized += 1
                events.append(Event(bytes(self._buffer), None))
                self._buffer.clear()
        return events

    def tail(self, n: int) -> bytes:
        """The last ``n`` buffered bytes of an unfinished event."""
        return bytes(self._buffer[-n:])

    def flush(self) -> Event | None:
        """What is left when the stream ends: an unterminated last event, if any."""
        if not self._buffer:
            return None
        raw = bytes(self._buffer)
        self._buffer.clear()
        return Event(raw, _data(raw))


def _data(raw: bytes) -> bytes | None:
    if raw.startswith(b"data: ") and raw.count(b"\n") == 2:  # the usual one-line event
        return raw[6:].rstrip(b"\r\n")
    parts = []
    for line in raw.splitlines():
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(parts) if parts else None


def encode_event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"
