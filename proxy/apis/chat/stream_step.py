"""One chat stream's events, each captured and given its client bytes in one step.

The relay (proxy.call.relay) would call ``Capture.add`` and ``strip_chunk`` on each
event: two decodes of the same chunk and one encode. For the chunks engines stream
token after token, ``ChunkCutter`` (proxy.apis.chat.strip_fast) makes both from one
msgspec call; every other chunk, and every chunk before the stream's head is known,
takes those two exact steps, and the first such chunk that both read whole teaches the
cutter the head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tracetap.proxy.apis import Injected
from tracetap.proxy.apis.chat.inject import strip_chunk
from tracetap.proxy.apis.chat.strip_fast import ChunkCutter
from tracetap.proxy.http.sse import Event, encode_event

if TYPE_CHECKING:
    from tracetap.proxy.apis.chat.capture import Capture

_HEAD_TRIES = 3  # exact chunks the head is looked for in before the stream keeps that path


class ChatStreamStep:
    """``capture.add(data)`` then the event's bytes for the client (``strip_event``)."""

    __slots__ = ("_capture", "_cutter", "_head_read", "_injected", "_tries")

    def __init__(self, capture: Capture, injected: Injected):
        self._capture, self._injected = capture, injected
        self._cutter = ChunkCutter(injected)
        self._tries = _HEAD_TRIES
        # Whether the capture's id, model and creation are the head's (what ``add``
        # would set again from a cut chunk): not after another chunk set them.
        self._head_read = False

    def __call__(self, data: bytes, event: Event) -> bytes:
        """``data``: the chunk as capture reads it (``event.data``, or less its prompt
        ids); raises what ``strip_chunk`` raises (the caller relays ``event.raw``)."""
        capture = self._capture
        if data is event.data:
            cut = self._cutter.cut(data)  # its choice's parts went to the capture
            if cut is not None:
                if not self._head_read:  # and what its head says, as ``add`` would set it
                    capture.add_head(self._cutter.head.body)  # type: ignore[union-attr]
                    self._head_read = True
                return cut
        read = capture.add(data)
        self._head_read = False
        chunk = strip_chunk(event.data or b"", self._injected)
        if read and self._tries and data is event.data and self._cutter.head is None:
            self._tries -= 1
            self._cutter.learn(data)
            head = self._cutter.head
            if head is not None:
                self._cutter.add = capture.delta_adder(head.body.choices[0].index)
                self._head_read = True
        return b"" if chunk is None else encode_event(chunk)
