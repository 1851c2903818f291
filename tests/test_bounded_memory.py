"""What one proxy process keeps in memory stays bounded (the tagger's: test_keys.py)."""

from __future__ import annotations

from tracetap.proxy.arrivals import Arrivals


def test_arrival_counters_keep_the_most_recent_episodes_only():
    arrivals = Arrivals(size=3)
    assert [arrivals.next("a") for _ in range(3)] == [0, 1, 2]
    assert [arrivals.next("b"), arrivals.next("c"), arrivals.next("a")] == [0, 0, 3]
    assert arrivals.next("d") == 0  # a fourth episode: b, the least recently used, goes
    assert [arrivals.next("a"), arrivals.next("c"), arrivals.next("d")] == [4, 1, 1]
    assert not arrivals.served("b")
    assert arrivals.next("b") == 0  # forgotten, so it starts again
    assert arrivals.next(None) == 0  # untagged calls count like an episode of their own
