"""The Arrow shapes of the two datasets, in one place, and the builders that fill them.

Token columns are built straight from the bytes storage hands over (one concatenation
per batch, no Python int per token); logprobs are stored as float64 and
narrowed to float32 here, once.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from itertools import accumulate

import pyarrow as pa
import pyarrow.compute as pc

from tracetap.exporters.annotate import PageNotes
from tracetap.exporters.experts import call_experts
from tracetap.exporters.factors import factors_of_json
from tracetap.exporters.images import IMAGE_ROWS, IMAGES_COLUMN, ImageSink, call_images
from tracetap.exporters.policy import call_spans
from tracetap.exporters.trajectories import Trajectory
from tracetap.storage.scan import BODIES, COLUMN, ROW, ScannedEpisode

# Bump when a column is added, removed or changes type; readers can check the file
# metadata key below.
SCHEMA_VERSION = "6"  # 2: token origin, the engine's view of the request, drift columns;
# 3: harness_factors (trajectories), overlay (calls); 4: integrity and lineage columns
# (both datasets; exporters.annotate), policy spans and mixed_policy (both), routed experts;
# 5: finish_seq (both: which export of a finished-again episode supersedes which)
# 6: images (both: each image with its placeholder span; exporters.images), images/;
#    continues_trajectory_id and summary_call_id (trajectories: compacted segments)
METADATA_SCHEMA_VERSION = b"tracetap.schema_version"
METADATA_TRACETAP_VERSION = b"tracetap.version"
METADATA_DATASET = b"tracetap.dataset"

_TIME = pa.timestamp("us", tz="UTC")
_IDS = pa.list_(pa.int32())
# [start, end) runs of tokens with the policy version that sampled them (exporters.policy).
SPANS = pa.list_(pa.struct([("start", pa.int32()), ("end", pa.int32()),
                            ("version", pa.string())]))
# Per token, [layers][top_k] MoE expert ids (exporters.experts).
ROUTING = pa.list_(pa.list_(pa.list_(pa.int16())))

CALLS = pa.schema([
    ("call_id", pa.string()),
    ("choice_index", pa.int32()),  # null for a call that returned no choice (errors)
    ("episode_id", pa.string()),
    ("group_id", pa.string()),
    ("task_id", pa.string()),
    ("seq", pa.int64()),
    ("t_start", _TIME),
    ("t_end", _TIME),
    ("endpoint", pa.string()),
    ("model", pa.string()),
    ("policy_version", pa.string()),
    ("request", pa.string()),  # JSON text
    ("response", pa.string()),  # JSON text; streams reassembled
    ("upstream_request", pa.string()),  # JSON text the engine got, when not `request`
    ("overlay", pa.string()),  # JSON text: the overlay's record of the call, if one ran
    ("prompt_ids", _IDS),
    ("prompt_source", pa.string()),
    ("ids_missing", pa.string()),  # why token ids are missing, when they are
    ("completion_ids", _IDS),
    ("completion_logprobs", pa.list_(pa.float32())),
    ("token_source", pa.string()),
    ("finish_reason", pa.string()),
    ("status", pa.string()),
    ("http_status", pa.int32()),
    ("error", pa.string()),
    ("prompt_tokens", pa.int32()),
    ("completion_tokens", pa.int32()),
    ("reward", pa.float64()),
    # The episode's finish this row was exported with (1, 2, ...): a later one supersedes.
    ("finish_seq", pa.int32()),
    # The episode's integrity verdict (storage.integrity), this call's own cause, and the
    # conversation inside the episode the call belongs to (exporters.lineages).
    ("integrity", pa.string()),
    ("integrity_cause", pa.string()),
    ("lineage_id", pa.string()),
    ("parent_lineage_id", pa.string()),
    # The policy version of each completion token, as [start, version) runs
    # (exporters.policy): a trainer drops or reweights off-policy tokens; null for a
    # call without a choice.
    ("policy_spans", SPANS),
    ("mixed_policy", pa.bool_()),
    ("routed_experts", ROUTING),  # aligned with completion_ids (--routed-experts)
    ("images", IMAGES_COLUMN),  # [{sha256, media_type, url, start, end}] in prompt_ids
])

_CAUSES = pa.list_(pa.struct([("cause", pa.string()), ("calls", pa.int32())]))

TRAJECTORIES = pa.schema([
    ("trajectory_id", pa.string()),
    ("episode_id", pa.string()),
    ("group_id", pa.string()),
    ("task_id", pa.string()),
    ("call_ids", pa.list_(pa.string())),
    ("choice_indices", pa.list_(pa.int32())),
    ("prompt_ids", _IDS),
    ("response_ids", _IDS),
    ("response_mask", pa.list_(pa.int8())),
    ("response_logprobs", pa.list_(pa.float32())),
    ("num_turns", pa.int32()),
    ("split_reason", pa.string()),
    ("finish_reason", pa.string()),
    ("policy_versions", pa.list_(pa.string())),
    ("reward", pa.float64()),
    ("finish_seq", pa.int32()),  # the finish exported (a later one supersedes this row)
    ("rewards", pa.string()),  # JSON {name: value}
    ("outcome", pa.string()),
    ("harness", pa.string()),
    ("harness_config", pa.string()),  # JSON text
    # The config's scalar values as [{factor, level}] (exporters.factors), to balance by.
    ("harness_factors", pa.list_(pa.struct([("factor", pa.string()), ("level", pa.string())]))),
    # Why a "non_prefix" row split (exporters.trajectories, exporters.drift).
    ("drift_cause", pa.string()),
    ("drift_position", pa.int32()),  # first differing token of prompt_ids
    ("drift_expected_token", pa.int32()),
    ("drift_received_token", pa.int32()),
    ("drift_message_index", pa.int32()),  # first differing message of the request
    ("drift_expected_text", pa.string()),
    ("drift_received_text", pa.string()),
    ("drift_call_id", pa.string()),  # the earlier call whose context was expected
    ("integrity", pa.string()),  # clean / infra (storage.integrity)
    ("integrity_causes", _CAUSES),  # [{cause, calls}], empty when clean
    ("lineage_id", pa.string()),  # the conversation inside the episode (exporters.lineages)
    ("parent_lineage_id", pa.string()),
    # A "compaction" row: the row it continues, the call that wrote the summary
    # (exporters.compaction).
    ("continues_trajectory_id", pa.string()),
    ("summary_call_id", pa.string()),
    # The policy version of each response token as runs (exporters.policy), and
    # whether the trained tokens are not all from one known version (a weight sync
    # landed mid-trajectory).
    ("response_policy_spans", SPANS),
    ("mixed_policy", pa.bool_()),
    ("response_routed_experts", ROUTING),  # aligned with response_ids (--routed-experts)
    # [{sha256, media_type, url, start, end}]: spans in prompt_ids + response_ids.
    ("images", IMAGES_COLUMN),
])
_DRIFT = ("drift_cause", "drift_position", "drift_expected_token", "drift_received_token",
          "drift_message_index", "drift_expected_text", "drift_received_text", "drift_call_id")

SCHEMAS = {"calls": CALLS, "trajectories": TRAJECTORIES, "images": IMAGE_ROWS}
# A run's ledger (exporters.parquet.LEDGER): each call written to calls/, once, with its
# episode's finished_at as stored (the version exported): what `tracetap prune` trusts.
CALL_LEDGER = pa.schema([
    ("call_id", pa.string()),
    ("episode_id", pa.string()),  # null for a call that carried no episode
    ("finished_at", pa.float64()),  # epoch seconds; null for an unfinished episode
])
# Characters of request + response text per calls batch: at most 4 UTF-8 bytes each, so
# a batch's string columns stay under Arrow's 2 GiB per array.
BODY_CHARS_PER_BATCH = 256 << 20

TrajectoryRow = tuple[ScannedEpisode, Trajectory]


def with_metadata(schema: pa.Schema, dataset: str, tracetap_version: str) -> pa.Schema:
    return schema.with_metadata({
        METADATA_SCHEMA_VERSION: SCHEMA_VERSION.encode(),
        METADATA_TRACETAP_VERSION: tracetap_version.encode(),
        METADATA_DATASET: dataset.encode(),
    })


def calls_batches(rows: Sequence[tuple], episodes: Sequence[ScannedEpisode],
                  schema: pa.Schema = CALLS, notes: PageNotes | None = None,
                  images: ImageSink | None = None) -> Iterator[pa.RecordBatch]:
    """``calls_batch`` over ``rows`` cut at call boundaries into pieces whose bodies fit
    one Arrow string array (2 GiB): a page of long agent episodes resends the whole
    conversation in every request."""
    call_id = COLUMN.call_id
    start, chars = 0, 0
    for i, row in enumerate(rows):
        size = sum(len(row[b] or "") for b in BODIES)
        new_call = i > start and row[call_id] != rows[i - 1][call_id]
        if new_call and chars + size > BODY_CHARS_PER_BATCH:
            yield calls_batch(rows[start:i], episodes, schema, notes, images)
            start, chars = i, 0
        chars += size
    yield calls_batch(rows[start:], episodes, schema, notes, images)


def calls_batch(rows: Sequence[tuple], episodes: Sequence[ScannedEpisode],
                schema: pa.Schema = CALLS, notes: PageNotes | None = None,
                images: ImageSink | None = None) -> pa.RecordBatch:
    """Scanned rows (storage.scan.ROW, one per call and choice) → the calls dataset.

    Column by column: the rows are transposed once, in C, and no Python code runs per row
    but for the lookup of each row's episode fields.
    """
    columns = dict(zip(ROW, zip(*rows))) if rows else dict.fromkeys(ROW, ())
    episode_ids = columns["episode_id"]

    def of_episode(field: str) -> list:
        return list(map({e.id: getattr(e, field) for e in episodes}.get, episode_ids))

    built = {
        "group_id": of_episode("group_id"),
        "task_id": of_episode("task_id"),
        "reward": of_episode("reward"),
        "finish_seq": list(map({e.id: finish_seq(e) for e in episodes}.get, episode_ids)),
        "t_start": _times(columns["t_start"]),
        "t_end": _times(columns["t_end"]),
        "prompt_ids": list_column(columns["prompt_ids"], pa.int32()),
        "completion_ids": list_column(columns["completion_ids"], pa.int32()),
        "completion_logprobs": list_column(columns["completion_logprobs"], pa.float64(),
                                           pa.float32()),
        **_call_notes(columns, notes or PageNotes({}, {}, {})),
        **call_spans(columns),
        "routed_experts": call_experts(columns),
        "images": call_images(columns, images or ImageSink()),
    }
    # Every other column is the scanned column of the same name, as it is.
    built.update((name, columns[name]) for name in schema.names if name not in built)
    return _batch(built, schema)


def finish_seq(episode: ScannedEpisode) -> int | None:
    """The episode's finish as exported: 1 for a finish stored before they were counted."""
    if episode.finish_seq is None and episode.finished_at is not None:
        return 1
    return episode.finish_seq


def _call_notes(columns: dict, notes: PageNotes) -> dict[str, list]:
    """The integrity and lineage columns of the calls dataset."""
    lineages = [notes.lineage_ids(c) for c in columns["call_id"]]
    return {
        "integrity": [notes.verdict(e).integrity for e in columns["episode_id"]],
        "integrity_cause": list(map(notes.causes.get, columns["call_id"])),
        "lineage_id": [lineage for lineage, _ in lineages],
        "parent_lineage_id": [parent for _, parent in lineages],
    }


def ledger_batch(calls: pa.RecordBatch, episodes: Sequence[ScannedEpisode],
                 schema: pa.Schema = CALL_LEDGER) -> pa.RecordBatch:
    """The calls of a calls/ batch, once each (a call has a row per choice)."""
    finished = {e.id: e.finished_at for e in episodes}
    pairs = dict.fromkeys(zip(calls.column("call_id").to_pylist(),
                              calls.column("episode_id").to_pylist()))
    return _batch({"call_id": [c for c, _ in pairs], "episode_id": [e for _, e in pairs],
                   "finished_at": [finished.get(e) for _, e in pairs]}, schema)


def trajectories_batch(rows: Sequence[TrajectoryRow], schema: pa.Schema = TRAJECTORIES,
                       notes: PageNotes | None = None,
                       images: Sequence[list] | None = None) -> pa.RecordBatch:
    episodes = [e for e, _ in rows]
    trajectories = [t for _, t in rows]
    columns = {**_trajectory_columns(trajectories), **_episode_columns(episodes),
               **_trajectory_notes(episodes, trajectories, notes),
               "images": images if images is not None else [[]] * len(rows)}
    return _batch(columns, schema)


def _trajectory_columns(trajectories: Sequence[Trajectory]) -> dict:
    """The columns a trajectory row holds itself (the batch orders them by the schema)."""
    return {
        "trajectory_id": [t.trajectory_id for t in trajectories],
        "call_ids": [t.call_ids for t in trajectories],
        "choice_indices": [t.choice_indices for t in trajectories],
        "prompt_ids": list_column([t.prompt_ids for t in trajectories], pa.int32()),
        "response_ids": list_column([t.response_ids for t in trajectories], pa.int32()),
        "response_mask": list_column([t.response_mask for t in trajectories], pa.int8()),
        "response_logprobs": list_column([t.response_logprobs for t in trajectories],
                                         pa.float64(), pa.float32()),
        "num_turns": [t.num_turns for t in trajectories],
        "split_reason": [t.split_reason for t in trajectories],
        "finish_reason": [t.finish_reason for t in trajectories],
        "policy_versions": [t.policy_versions for t in trajectories],
        **{name: [getattr(t, name) for t in trajectories] for name in _DRIFT},
        "response_policy_spans": [t.response_policy_spans for t in trajectories],
        "mixed_policy": [t.mixed_policy for t in trajectories],
        "response_routed_experts": [t.response_routed_experts for t in trajectories],
    }


def _episode_columns(episodes: Sequence[ScannedEpisode]) -> dict:
    """The columns each row repeats from its episode."""
    return {
        "episode_id": [e.id for e in episodes],
        "group_id": [e.group_id for e in episodes],
        "task_id": [e.task_id for e in episodes],
        "reward": [e.reward for e in episodes],
        "finish_seq": [finish_seq(e) for e in episodes],
        "rewards": [e.rewards for e in episodes],
        "outcome": [e.outcome for e in episodes],
        "harness": [e.harness_name for e in episodes],
        "harness_config": [e.harness_config for e in episodes],
        "harness_factors": [factors_of_json(e.harness_config) for e in episodes],
    }


def _trajectory_notes(episodes: Sequence[ScannedEpisode], trajectories: Sequence[Trajectory],
                      notes: PageNotes | None) -> dict[str, list]:
    """The integrity and lineage columns of the trajectories dataset."""
    notes = notes or PageNotes({}, {}, {})
    verdicts = [notes.verdict(e.id) for e in episodes]
    return {
        "integrity": [v.integrity for v in verdicts],
        "integrity_causes": [[{"cause": c, "calls": n} for c, n in v.causes.items()]
                             for v in verdicts],
        "lineage_id": [t.lineage_id for t in trajectories],
        "parent_lineage_id": [t.parent_lineage_id for t in trajectories],
        "continues_trajectory_id": [t.continues_trajectory_id for t in trajectories],
        "summary_call_id": [t.summary_call_id for t in trajectories],
    }


def list_column(values: Sequence[bytes | array | None], stored: pa.DataType,
                exported: pa.DataType | None = None) -> pa.Array:
    """A list column with one buffer copy, from bytes of ``stored`` values in native order
    or from ``array``s of them (not a mix); None is a null list."""
    present = [v for v in values if v is not None] if None in values else values
    lengths = map(len, values) if present is values else (
        0 if v is None else len(v) for v in values)
    ends = array("q", accumulate(lengths, initial=0))
    offsets = pa.Array.from_buffers(pa.int64(), len(ends), [None, pa.py_buffer(ends)])
    if present and type(present[0]) is bytes:  # lengths were in bytes
        offsets = pc.divide(offsets, stored.bit_width // 8)
    data = pa.py_buffer(b"".join(present))
    flat = pa.Array.from_buffers(stored, len(data) * 8 // stored.bit_width, [None, data])
    if exported is not None and exported != stored:
        flat = pc.cast(flat, exported, safe=False)  # float64 → float32: rounding, on purpose
    mask = pa.array([v is None for v in values], pa.bool_()) if present is not values else None
    return pa.ListArray.from_arrays(pc.cast(offsets, pa.int32()), flat, mask=mask)


def _times(seconds: Sequence[float | None]) -> pa.Array:
    micros = pc.cast(pc.round(pc.multiply(pa.array(seconds, pa.float64()), 1e6)), pa.int64())
    return micros.view(_TIME)


def _batch(columns: dict, schema: pa.Schema) -> pa.RecordBatch:
    arrays = [
        value if isinstance(value, pa.Array) else pa.array(value, field.type)
        for field, value in ((schema.field(name), columns[name]) for name in schema.names)
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
