"""What one proxy process keeps in memory stays bounded."""

from __future__ import annotations

from tracetap.proxy import state as state_module
from tracetap.proxy.settings import Settings
from tracetap.proxy.state import ProxyState


def test_arrival_counters_keep_the_most_recent_episodes_only(monkeypatch):
    monkeypatch.setattr(state_module, "SEQ_EPISODES", 3)
    state = ProxyState(Settings(upstream=["http://127.0.0.1:9"]), engine=None, writer=None,
                       pool=None, tagger=None, metrics=None, admin_token="t")
    assert [state.next_seq("a") for _ in range(3)] == [0, 1, 2]
    assert [state.next_seq("b"), state.next_seq("c"), state.next_seq("a")] == [0, 0, 3]
    assert state.next_seq("d") == 0  # a fourth episode: b, the least recently used, goes
    assert [state.next_seq("a"), state.next_seq("c"), state.next_seq("d")] == [4, 1, 1]
    assert state.next_seq("b") == 0  # forgotten, so it starts again
    assert state.next_seq(None) == 0  # untagged calls count like an episode of their own
