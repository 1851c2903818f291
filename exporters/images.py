"""What a vision-language trainer needs to rebuild a prompt with its pixels: each image of
a row with where its placeholder tokens are, and the images themselves, once per export
directory (an incremental run skips those its manifest says earlier runs wrote).

An engine serving a VLM expands each image of the request into a run of one pad token
(vLLM with Qwen2-VL .. Qwen3-VL: ``<|image_pad|>`` repeated once per vision embedding,
between ``<|vision_start|>`` and ``<|vision_end|>``). The images of the body the engine
got (the translated chat body when there is one, else the request: storage.image_parts)
are matched in order with the runs of the first known pad id (``PAD_IDS``) that has
exactly as many runs as the body has images; when none does, the row still lists its
images, with null positions. Positions are [start, end) token offsets: in ``prompt_ids``
(calls), in ``prompt_ids`` followed by ``response_ids`` (trajectories).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any

import pyarrow as pa

from tracetap.exporters.parquet import IMAGES, DatasetWriter
from tracetap.exporters.trajectories import Trajectory
from tracetap.storage.image_parts import ImagePart, image_parts
from tracetap.storage.scan import Reader, ScannedEpisode

# Pad token ids: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (<|image_pad|>); Gemma 3
# (<image_soft_token>); the mock engine (demo.tokenizer.IMAGE_PAD).
PAD_IDS = (151655, 262144, 261)

IMAGE = pa.struct([("sha256", pa.string()), ("media_type", pa.string()),
                   ("url", pa.string()), ("start", pa.int32()), ("end", pa.int32())])
IMAGES_COLUMN = pa.list_(IMAGE)
# The images/ dataset: each image's bytes once per export directory, keyed by its SHA-256.
IMAGE_ROWS = pa.schema([("sha256", pa.string()), ("media_type", pa.string()),
                    ("bytes", pa.int64()), ("data", pa.binary())])


def pad_runs(ids: bytes, pad: int) -> list[tuple[int, int]]:
    """[start, end) runs of ``pad`` in native int32 ``ids`` (found with bytes.find)."""
    needle = struct.pack("=i", pad)
    runs: list[tuple[int, int]] = []
    at = ids.find(needle)
    while at >= 0:
        if at % 4:
            at = ids.find(needle, at + 1)
            continue
        end = at + 4
        while ids[end:end + 4] == needle:
            end += 4
        runs.append((at // 4, end // 4))
        at = ids.find(needle, end)
    return runs


def placed(images: Sequence[ImagePart], ids: bytes | None) -> list[dict[str, Any]]:
    """The column value of one row: its images, with their placeholder spans in ``ids``
    when one pad id's runs match them one to one."""
    spans: list[tuple[int, int]] | list[tuple[None, None]] = [(None, None)] * len(images)
    if images and ids:
        for pad in PAD_IDS:
            runs = pad_runs(ids, pad)
            if len(runs) == len(images):
                spans = runs
                break
    return [{"sha256": i.sha256, "media_type": i.media_type, "url": i.url,
             "start": start, "end": end} for i, (start, end) in zip(images, spans)]


def engine_body(request: str | None, upstream_request: str | None) -> str | None:
    """The body whose images the engine rendered: the one sent upstream."""
    return upstream_request if upstream_request is not None else request


class ImageSink:
    """The images of an export run: each one's bytes kept until written, once per export
    directory (``earlier``: the hashes its earlier runs wrote, from the manifest)."""

    def __init__(self, earlier: Iterable[str] = ()) -> None:
        self.seen: set[str] = set(earlier)
        self.pending: list[ImagePart] = []
        self.written: list[str] = []  # this run's, for its manifest entry

    def images(self, body: str | None) -> list[ImagePart]:
        parts = image_parts(body)
        for part in parts:
            if part.sha256 is not None and part.sha256 not in self.seen:
                self.seen.add(part.sha256)
                self.pending.append(part)
        return parts

    def write(self, writer: DatasetWriter) -> None:
        """The images found since the last write, to the ``IMAGES`` dataset."""
        assert writer.dataset == IMAGES
        if not self.pending:
            return
        parts, self.pending = self.pending, []
        self.written.extend(p.sha256 for p in parts if p.sha256 is not None)
        writer.add(pa.RecordBatch.from_pydict({
            "sha256": [p.sha256 for p in parts],
            "media_type": [p.media_type for p in parts],
            "bytes": [len(p.data or b"") for p in parts],
            "data": [p.data for p in parts]}, schema=writer.schema))


def column(values: Iterable[list[dict[str, Any]]]) -> pa.Array:
    return pa.array(list(values), IMAGES_COLUMN)


def call_images(columns: dict, sink: ImageSink) -> list[list[dict[str, Any]]]:
    """The calls dataset's column: each row's images placed in its prompt ids (a call's
    rows, one per choice, share one value)."""
    done: dict[str, list[dict[str, Any]]] = {}
    out = []
    for call_id, request, upstream, ids in zip(
            columns["call_id"], columns["request"], columns["upstream_request"],
            columns["prompt_ids"]):
        value = done.get(call_id)
        if value is None:
            body = engine_body(request, upstream)
            value = done[call_id] = placed(sink.images(body), ids) if body else []
        out.append(value)
    return out


def may_hold_images(ids: bytes) -> bool:
    """Whether token ids hold a known pad id: the trajectories of an export without the
    calls dataset read bodies only for those."""
    return any(struct.pack("=i", pad) in ids for pad in PAD_IDS)


async def trajectory_images(rows: Sequence[tuple[ScannedEpisode, Trajectory]], reader: Reader,
                            sink: ImageSink) -> list[list[dict[str, Any]]]:
    """The trajectories dataset's column: the images of each row's last call (its prompt
    is the row's prompt_ids + response_ids but for that call's own completion), placed in
    prompt_ids + response_ids. Read without bodies (no calls dataset), the bodies of the
    rows whose tokens hold a known pad id are read here."""
    calls = {c.call_id: c for e, _ in rows for c in e.calls}
    if not reader.with_bodies:
        calls = await reader.bodies(sorted({t.call_ids[-1] for _, t in rows if t.call_ids and (
            may_hold_images(t.prompt_ids.tobytes()) or may_hold_images(t.response_ids.tobytes()))}))
    out = []
    for _, t in rows:
        call = calls.get(t.call_ids[-1]) if t.call_ids else None
        parts = sink.images(engine_body(call.request, call.upstream_request)) if call else []
        out.append(placed(parts, t.prompt_ids.tobytes() + t.response_ids.tobytes())
                   if parts else [])
    return out
