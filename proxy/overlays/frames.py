"""The wire between the proxy and a patch's worker process: msgspec frames over pipes.

Each frame is a 4-byte big-endian length and a msgpack body. The proxy sends a ``Load``
once, then ``Call`` frames, one at a time; the worker answers each with one ``Answer``.
Hook arguments and results are the typed values of ``hooks``; a result travels as its
kind and its msgpack bytes, and is decoded into exactly that type on the proxy's side, so
a worker that writes anything else is a broken worker, never a value the proxy trusts.
"""

from __future__ import annotations

import struct
from typing import Any, Literal

import msgspec

from tracetap.proxy.overlays.hooks import (
    EpisodeInfo,
    Inject,
    ModelReply,
    ModelRequest,
    Observation,
    Rewrite,
    Veto,
)

MAX_FRAME = 64 * 1024 * 1024  # a request's messages can be large; more is a broken worker
_HEADER = struct.Struct(">I")


class Load(msgspec.Struct, tag=True, kw_only=True):
    """Compile and run the patch's source as a module (once per worker)."""

    name: str
    source: str


class Loaded(msgspec.Struct, tag=True, kw_only=True):
    """The patch loaded: the hooks it defines, and what the worker could confine."""

    hooks: list[str]
    after_model_sees: str
    network_namespace: bool  # a network namespace of its own (bubblewrap's, or unshare's)
    limits: dict[str, int]  # the rlimits set, by name
    sandbox: str = "unsandboxed"  # "bwrap": in bubblewrap's namespaces (overlays.bwrap)
    uid: int = -1  # the user it runs the patch as
    seccomp: bool = False  # the filter of overlays.seccomp is on


class Call(msgspec.Struct, tag=True, kw_only=True):
    """One hook for one episode. ``start`` carries the registration (``on_episode_start``
    and the state it returns are the worker's: the proxy never sees a patch's state)."""

    id: int
    hook: str
    episode: str
    start: EpisodeInfo | None = None
    request: ModelRequest | None = None
    reply: ModelReply | None = None
    observations: list[Observation] | None = None


class Answer(msgspec.Struct, tag=True, kw_only=True):
    id: int
    kind: Literal["none", "inject", "rewrite", "veto", "error"]
    value: bytes | None = None  # the result's msgpack, for inject/rewrite/veto
    error: str | None = None  # "TypeError: ..." when the hook raised or returned junk


class Failed(msgspec.Struct, tag=True, kw_only=True):
    """The patch did not load (the worker exits after sending it)."""

    error: str


ToWorker = Load | Call
FromWorker = Loaded | Answer | Failed
RESULTS: dict[str, type] = {"inject": Inject, "rewrite": Rewrite, "veto": Veto}

_encoder = msgspec.msgpack.Encoder()
to_worker = msgspec.msgpack.Decoder(ToWorker).decode
from_worker = msgspec.msgpack.Decoder(FromWorker).decode


def frame(message: Any) -> bytes:
    body = _encoder.encode(message)
    return _HEADER.pack(len(body)) + body


def encode(value: Any) -> bytes:
    return _encoder.encode(value)


def length(header: bytes) -> int:
    (n,) = _HEADER.unpack(header)
    if n > MAX_FRAME:
        raise ValueError(f"a frame of {n} bytes (at most {MAX_FRAME})")
    return n


def result(answer: Answer) -> Inject | Rewrite | Veto | None:
    """The hook's value, decoded into its own type (ValueError if it is not one)."""
    if answer.kind == "none":
        return None
    kind = RESULTS.get(answer.kind)
    if kind is None or answer.value is None:
        raise ValueError(f"the worker answered {answer.kind!r} without a value")
    try:
        return msgspec.msgpack.decode(answer.value, type=kind)
    except msgspec.ValidationError as exc:
        raise ValueError(f"the worker's {answer.kind} is malformed: {exc}") from exc
