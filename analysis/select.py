"""Selectors (``harness=A,config.retry=3``) and what counts as a success.

A selector is ``KEY=VALUE`` terms joined by commas; an episode matches when every term
holds. Keys: ``harness`` (the harness name), ``task``, ``group``, ``outcome``,
``policy`` (a policy version one of its calls ran under), ``overlay`` (the episode's
metadata key ``overlay``, set by a model-boundary overlay), ``label`` (a label a person
gave the episode, one of its calls or a token span: storage.annotations), ``config.NAME``
(a factor of the harness config) and ``meta.NAME`` (a metadata key). Values compare as text, with
numbers, booleans and null in their JSON spelling (``config.retries=3``); a key an
episode lacks reads as null (``overlay=null``: the episodes run without an overlay).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from tracetap.analysis.episodes import AnalysisError, Episode
from tracetap.exporters.factors import level

_FIELDS: dict[str, Callable[[Episode], str | None]] = {
    "harness": lambda e: e.summary.harness_name,
    "task": lambda e: e.summary.task_id,
    "group": lambda e: e.summary.group_id,
    "outcome": lambda e: e.summary.outcome,
    "overlay": lambda e: level(e.metadata.get("overlay")),
}
KEYS = (*_FIELDS, "policy", "label", "config.NAME", "meta.NAME")
_SETS = ("policy", "label")  # keys an episode has several values of


class Selector(msgspec.Struct, frozen=True):
    text: str
    terms: tuple[tuple[str, str], ...]

    @property
    def needs_policies(self) -> bool:
        return any(key == "policy" for key, _ in self.terms)

    def matches(self, episode: Episode) -> bool:
        return all(_value_matches(episode, key, value) for key, value in self.terms)


def parse_selector(text: str) -> Selector:
    terms = []
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        key = key.strip()
        if not sep or not key or not value.strip():
            raise AnalysisError(
                f"selector {text!r}: {part.strip()!r} is not KEY=VALUE (keys: {', '.join(KEYS)})"
            )
        known = (
            key in _FIELDS
            or key in _SETS
            or (key.partition(".")[0] in ("config", "meta") and key.partition(".")[2])
        )
        if not known:
            raise AnalysisError(
                f"selector {text!r}: unknown key {key!r} (keys: "
                f"{', '.join(KEYS)}; a harness factor is config.{key})"
            )
        terms.append((key, value.strip()))
    return Selector(text, tuple(terms))


def value_of(episode: Episode, key: str) -> str | None:
    """The episode's value for a selector key (not ``policy`` or ``label``: an episode
    has several)."""
    if key in _FIELDS:
        return _FIELDS[key](episode)
    scope, _, name = key.partition(".")
    if scope == "config":
        return episode.factors.get(name)
    return level(episode.metadata[name]) if name in episode.metadata else None


def check_key(key: str, what: str) -> None:
    if key in _SETS or not (
        key in _FIELDS or (key.partition(".")[0] in ("config", "meta") and key.partition(".")[2])
    ):
        keys = ", ".join(k for k in KEYS if k not in _SETS)
        raise AnalysisError(f"{what} {key!r} is not one of {keys}")


def _value_matches(episode: Episode, key: str, value: str) -> bool:
    if key == "policy":
        return value in episode.policies
    if key == "label":  # `label=null`: the episodes nobody labelled
        if episode.labels is None:  # never a silent "no label": the caller forgot to read them
            raise AnalysisError("a label= selector needs the episodes read with their labels")
        return value in episode.labels or (value == "null" and not episode.labels)
    actual = value_of(episode, key)
    # A key the episode lacks reads as JSON null: `overlay=null` picks the plain runs.
    return actual == value or (actual is None and value == "null")


class Success(msgspec.Struct, frozen=True):
    """An episode succeeded when its outcome is one of ``outcomes``, or else when its
    reward is at least ``threshold`` (an episode without either is a failure)."""

    outcomes: tuple[str, ...] = ("success",)
    threshold: float = 1.0

    def __call__(self, episode: Episode) -> bool:
        s = episode.summary
        if s.outcome is not None and s.outcome in self.outcomes:
            return True
        return s.reward is not None and s.reward >= self.threshold
