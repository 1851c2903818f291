"""Infra episodes in harness engineering: an episode whose calls show an infrastructure
cause (storage.integrity: an upstream failure, a refusal, a lost record...) says nothing
about its harness, so ``tracetap packets`` writes no failure packet for it and
``tracetap compare`` leaves it out of Δ_B; both say how many they left out. An attempt
``tracetap run`` was stopped in (outcome ``interrupted``) is infra too (analysis.episodes)."""

from __future__ import annotations

from collections.abc import Sequence

from tracetap.analysis.episodes import AnalysisError, Episode


def clean(episodes: Sequence[Episode]) -> tuple[list[Episode], int]:
    """The episodes whose verdict is clean, and how many infra ones were left out."""
    kept = [e for e in episodes if not e.integrity.infra]
    return kept, len(episodes) - len(kept)


def clean_variant(episodes: Sequence[Episode], selector_text: str) -> tuple[list[Episode], int]:
    """``clean`` for one side of a comparison: an error when nothing clean is left."""
    kept, infra = clean(episodes)
    if not kept:
        raise AnalysisError(
            f"all {infra} episodes of {selector_text!r} have integrity infra (an upstream "
            "failure, a refusal, a lost record: see the viewer or the export's "
            "integrity_causes): nothing left to compare")
    return kept, infra
