"""What an export tells a person: the summary line, and which --episode ids were left out
and how to include them. No pyarrow here: the CLI imports it to describe its flags."""

from __future__ import annotations


def summary_line(summary, out: str) -> str:
    """``exported 2 episodes: 5 calls (1,234 token ids); 2 trajectories (...)``."""
    s = summary
    return (
        f"exported {plural(s.episodes, 'episode')}: "
        f"{plural(s.calls, 'call')} ({plural(s.call_ids, 'token id')}), "
        f"{plural(s.trajectories, 'trajectory', 'trajectories')} "
        f"({plural(s.trajectory_ids, 'token id')}, {s.trained_tokens:,} trained), "
        f"{plural(len(s.files), 'file')} in {s.seconds:.1f}s -> {out}"
    )


def missing_note(not_found: list[str], not_finished: list[str]) -> str:
    """One line on the --episode ids left out, and how to include them."""
    parts = []
    if not_found:
        parts.append(f"{_ids(not_found)} not found in the database")
    if not_finished:
        parts.append(
            f"{_ids(not_finished)} not finished (finish with POST "
            "/tracetap/episodes/{id}/finish, or add --no-finished-only to export "
            "unfinished episodes)"
        )
    return "; ".join(parts)


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``1 episode``, ``2 episodes``, ``1 trajectory``, ``3 trajectories``."""
    return f"1 {noun}" if n == 1 else f"{n:,} {nouns or noun + 's'}"


def _ids(ids: list[str], shown: int = 5) -> str:
    listed = ", ".join(repr(i) for i in ids[:shown])
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return f"{plural(len(ids), 'episode')} {listed}{more}"
