"""Trajectory rows → the per-sample fields RL trainers expect: one small function each.

A row is any mapping with the ``trajectories/`` columns: ``Table.to_pylist()`` items,
a ``datasets`` example, or ``DataFrame.iloc[i]`` (list columns may be numpy arrays).
Nothing here pads or batches; each trainer does that itself. A row without token ids
(``split_reason = "no_token_ids"``, exported only with ``--keep-untokenized``) is not
training data: every adapter raises ``UntrainableRow`` for it; filter with ``trainable``.

Every adapter takes ``policy=`` (exporters.policy.POLICY_CHOICES): "keep" (default) trains
every sampled token; "known" masks tokens whose policy version is unknown (sampled
during a weight sync); "latest" keeps only the row's newest known version; any other
string keeps only that version. Masked tokens stay in the sequence as context.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tracetap.exporters.policy import policy_mask


class UntrainableRow(ValueError):
    """A row without the token ids a trainer needs (its reward would train on nothing)."""


def trainable(row: Mapping[str, Any]) -> bool:
    """Whether a row carries the model's tokens: filter kept untokenized rows with this."""
    prompt = row["prompt_ids"]
    return row["split_reason"] != "no_token_ids" and prompt is not None and len(prompt) > 0


def _checked(row: Mapping[str, Any]) -> Mapping[str, Any]:
    if not trainable(row):
        raise UntrainableRow(f"trajectory {row.get('trajectory_id')!r} has no token ids "
                             f"(split_reason {row['split_reason']!r}); filter rows with "
                             "tracetap.exporters.adapters.trainable")
    return row


def _ints(values: Sequence[int] | None) -> list[int]:
    return [] if values is None else [int(v) for v in values]


def _floats(values: Sequence[float] | None) -> list[float] | None:
    return None if values is None else [float(v) for v in values]


def to_verl(row: Mapping[str, Any], policy: str = "keep") -> dict[str, Any]:
    """verl agent-loop output: response_mask 1 = LLM token; rollout_log_probs aligned."""
    row = _checked(row)
    return {
        "prompt_ids": _ints(row["prompt_ids"]),
        "response_ids": _ints(row["response_ids"]),
        "response_mask": policy_mask(row, policy),
        "rollout_log_probs": _floats(row["response_logprobs"]),
        "reward": row["reward"],
    }


def to_trl(row: Mapping[str, Any], policy: str = "keep") -> dict[str, Any]:
    """TRL GRPO ``rollout_func`` fields: env_mask 1 = model token (kept in the loss)."""
    row = _checked(row)
    return {
        "prompt_ids": _ints(row["prompt_ids"]),
        "completion_ids": _ints(row["response_ids"]),
        "logprobs": _floats(row["response_logprobs"]),
        "env_mask": policy_mask(row, policy),
    }


def to_slime(row: Mapping[str, Any], policy: str = "keep") -> dict[str, Any]:
    """slime ``Sample``: tokens = prompt + response; loss_mask covers the response."""
    row = _checked(row)
    response = _ints(row["response_ids"])
    return {
        "tokens": _ints(row["prompt_ids"]) + response,
        "response_length": len(response),
        "loss_mask": policy_mask(row, policy),
        "rollout_log_probs": _floats(row["response_logprobs"]),
        "reward": row["reward"],
    }


def to_openrlhf(row: Mapping[str, Any], policy: str = "keep") -> dict[str, Any]:
    """OpenRLHF agent sample: action_ranges are [start, end) spans of model tokens in
    ``sequences`` (prompt + response), one per trainable run of the mask."""
    row = _checked(row)
    prompt = _ints(row["prompt_ids"])
    mask = policy_mask(row, policy)
    ranges: list[tuple[int, int]] = []
    start = None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            ranges.append((len(prompt) + start, len(prompt) + i))
            start = None
    return {
        "sequences": prompt + _ints(row["response_ids"]),
        "action_ranges": ranges,
        "rollout_log_probs": _floats(row["response_logprobs"]),
        "reward": row["reward"],
    }


ADAPTERS = {"verl": to_verl, "trl": to_trl, "slime": to_slime, "openrlhf": to_openrlhf}
