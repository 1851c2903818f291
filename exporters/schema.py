"""The Arrow shapes of the two datasets, in one place, and the builders that fill them.

Token columns are built straight from the ``array`` buffers storage hands over (one
concatenation per batch, no Python int per token); logprobs are stored as float64 and
narrowed to float32 here, once.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

from exporters.trajectories import Trajectory
from storage.scan import ScannedCall, ScannedChoice, ScannedEpisode

# Bump when a column is added, removed or changes type; readers can check the file
# metadata key below.
SCHEMA_VERSION = "1"
METADATA_SCHEMA_VERSION = b"tracetap.schema_version"
METADATA_TRACETAP_VERSION = b"tracetap.version"
METADATA_DATASET = b"tracetap.dataset"

_TIME = pa.timestamp("us", tz="UTC")
_IDS = pa.list_(pa.int32())

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
    ("prompt_ids", _IDS),
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
])

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
    ("rewards", pa.string()),  # JSON {name: value}
    ("outcome", pa.string()),
    ("harness", pa.string()),
    ("harness_config", pa.string()),  # JSON text
])

SCHEMAS = {"calls": CALLS, "trajectories": TRAJECTORIES}

CallRow = tuple[ScannedEpisode | None, ScannedCall, ScannedChoice | None]
TrajectoryRow = tuple[ScannedEpisode, Trajectory]


def with_metadata(schema: pa.Schema, dataset: str, tracetap_version: str) -> pa.Schema:
    return schema.with_metadata({
        METADATA_SCHEMA_VERSION: SCHEMA_VERSION.encode(),
        METADATA_TRACETAP_VERSION: tracetap_version.encode(),
        METADATA_DATASET: dataset.encode(),
    })


def calls_batch(rows: Sequence[CallRow], schema: pa.Schema = CALLS) -> pa.RecordBatch:
    episodes = [e for e, _, _ in rows]
    calls = [c for _, c, _ in rows]
    choices = [ch for _, _, ch in rows]
    columns = {
        "call_id": [c.call_id for c in calls],
        "choice_index": [None if ch is None else ch.index for ch in choices],
        "episode_id": [c.episode_id for c in calls],
        "group_id": [None if e is None else e.group_id for e in episodes],
        "task_id": [None if e is None else e.task_id for e in episodes],
        "seq": [c.seq for c in calls],
        "t_start": _times([c.t_start for c in calls]),
        "t_end": _times([c.t_end for c in calls]),
        "endpoint": [c.endpoint for c in calls],
        "model": [c.model for c in calls],
        "policy_version": [c.policy_version for c in calls],
        "request": [c.request for c in calls],
        "response": [c.response for c in calls],
        "prompt_ids": list_column([c.prompt_ids for c in calls], pa.int32()),
        "completion_ids": list_column(
            [None if ch is None else ch.completion_ids for ch in choices], pa.int32()),
        "completion_logprobs": list_column(
            [None if ch is None else ch.completion_logprobs for ch in choices], pa.float64(),
            pa.float32()),
        "token_source": [None if ch is None else ch.token_source for ch in choices],
        "finish_reason": [None if ch is None else ch.finish_reason for ch in choices],
        "status": [c.status for c in calls],
        "http_status": [c.http_status for c in calls],
        "error": [c.error for c in calls],
        "prompt_tokens": [c.prompt_tokens for c in calls],
        "completion_tokens": [c.completion_tokens for c in calls],
        "reward": [None if e is None else e.reward for e in episodes],
    }
    return _batch(columns, schema)


def trajectories_batch(rows: Sequence[TrajectoryRow],
                       schema: pa.Schema = TRAJECTORIES) -> pa.RecordBatch:
    episodes = [e for e, _ in rows]
    trajectories = [t for _, t in rows]
    columns = {
        "trajectory_id": [t.trajectory_id for t in trajectories],
        "episode_id": [e.id for e in episodes],
        "group_id": [e.group_id for e in episodes],
        "task_id": [e.task_id for e in episodes],
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
        "reward": [e.reward for e in episodes],
        "rewards": [e.rewards for e in episodes],
        "outcome": [e.outcome for e in episodes],
        "harness": [e.harness_name for e in episodes],
        "harness_config": [e.harness_config for e in episodes],
    }
    return _batch(columns, schema)


def list_column(values: Sequence[array | None], stored: pa.DataType,
                exported: pa.DataType | None = None) -> pa.Array:
    """A list column from native arrays (None: a null list) with one buffer copy."""
    offsets = array("i", [0])
    total = 0
    nulls = False
    for value in values:
        if value is None:
            nulls = True
        else:
            total += len(value)
        offsets.append(total)
    data = b"".join(v for v in values if v is not None)
    flat = pa.Array.from_buffers(stored, total, [None, pa.py_buffer(data)])
    if exported is not None and exported != stored:
        flat = pc.cast(flat, exported, safe=False)  # float64 → float32: rounding, on purpose
    mask = pa.array([v is None for v in values], pa.bool_()) if nulls else None
    offsets_array = pa.Array.from_buffers(pa.int32(), len(offsets), [None, pa.py_buffer(offsets)])
    return pa.ListArray.from_arrays(offsets_array, flat, mask=mask)


def _times(seconds: list[float | None]) -> pa.Array:
    # From raw buffers on purpose: pa.array / cast / view to a zoned timestamp type make
    # pyarrow import pandas (half a second) just to look at the zone.
    micros = array("q", [0 if s is None else round(s * 1_000_000) for s in seconds])
    validity = None
    if None in seconds:
        validity = pa.array([s is not None for s in seconds], pa.bool_()).buffers()[1]
    return pa.Array.from_buffers(_TIME, len(seconds), [validity, pa.py_buffer(micros)])


def _batch(columns: dict, schema: pa.Schema) -> pa.RecordBatch:
    arrays = [
        value if isinstance(value, pa.Array) else pa.array(value, field.type)
        for field, value in ((schema.field(name), columns[name]) for name in schema.names)
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
