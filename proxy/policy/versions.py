"""Which policy version produced each token of a call: spans, not a version per call.

A call is stamped with the version in force when it was admitted (``ModelCall.admit``).
A weight sync (pause → new version → resume) or a version change may land while it runs;
then its tokens are not all from one version. ``CallVersions`` watches the shared
controls as the call's tokens arrive and keeps, per choice, the runs of tokens that
arrived under one known state as ``(start_token, version)`` spans:

- tokens that arrived while the proxy ran, with no change since the previous tokens
  arrived, carry the version in force;
- tokens that arrived while paused, or whose arrival window saw a change (a body that
  comes whole at the end of a call during which a sync happened; a stream read that
  straddles a resume), carry ``None``: unknown, never guessed.

A choice whose tokens are all from the admitted version gets no spans (storage reads
that as one span of ``calls.policy_version``), so the common case costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from tracetap.storage.policy_spans import Span
from tracetap.storage.records import ChoiceRecord


class _Controls(Protocol):
    policy_version: str | None
    serial: int


class _Gate(Protocol):
    paused: bool


class _State(Protocol):
    controls: _Controls
    gate: _Gate


class CallVersions:
    """The version spans of one call's choices, built as its tokens arrive; inert until
    the call is admitted (a call refused before the gate has no tokens to judge)."""

    def __init__(self, state: _State):
        self._state = state
        self.admitted: str | None = None
        self._serial: int | None = None  # the controls' serial when tokens last arrived
        self._counts: dict[int, int] = {}  # tokens seen so far, per choice
        self._spans: dict[int, list[Span]] = {}
        self._observed = False

    @property
    def active(self) -> bool:
        return self._serial is not None

    def admit(self) -> None:
        """The call passed the pause gate: its version is the one in force now."""
        self._controls, self._gate = self._state.controls, self._state.gate
        self.admitted = self._controls.policy_version
        self._serial = self._controls.serial

    def restart(self) -> None:
        """A new upstream request begins now (a continuation after a resume): tokens
        from here on are judged against the state at this moment."""
        if self._serial is not None:
            self._serial = self._controls.serial

    def now(self) -> str | None:
        """The version that tokens arriving now are from, if it is known."""
        serial = self._controls.serial
        changed = serial != self._serial
        self._serial = serial
        if changed or self._gate.paused:
            return None
        return self._controls.policy_version

    def observe(self, counts: Mapping[int, int] | None) -> None:
        """Tokens arrived: ``counts`` is how many each choice has now (once per stream
        read: its tokens arrived at one instant). ``now`` and the span's extension are
        written out here: this runs once a read of every stream."""
        if self._serial is None or counts is None:
            return
        self._observed = True
        controls = self._controls
        serial = controls.serial
        if serial != self._serial or self._gate.paused:  # as ``now``: unknown
            self._serial = serial
            version = None
        else:
            version = controls.policy_version
        seen, spans_of = self._counts, self._spans
        for index, count in counts.items():
            before = seen.get(index, 0)
            if count > before:  # (a read with no new token changes nothing)
                seen[index] = count
                spans = spans_of.get(index)
                if spans is None:
                    spans_of[index] = [(before, version)]
                elif spans[-1][1] != version:
                    spans.append((before, version))

    def stamp(self, choices: Iterable[ChoiceRecord]) -> None:
        """Set each choice's ``policy_spans`` (None when all its tokens are from the
        admitted version). A reply that was never observed token by token (a whole
        body) is judged once, now: unknown if anything changed since admission."""
        if self._serial is None:
            return
        if not self._observed:
            self.observe({c.index: _length(c) for c in choices})
        for choice in choices:
            spans = self._spans.get(choice.index)
            if spans and spans != [(0, self.admitted)]:
                choice.policy_spans = list(spans)


def _length(choice: ChoiceRecord) -> int:
    if choice.completion_ids is not None:
        return len(choice.completion_ids)
    if choice.completion_logprobs is not None:
        return len(choice.completion_logprobs)
    return 1 if choice.text else 0  # no ids: one "token" stands for the whole text
