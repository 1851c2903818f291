"""What one proxy process keeps in memory stays bounded (the tagger's: test_keys.py)."""

from __future__ import annotations

import asyncio
import gc

import openai
import pytest

from tracetap.proxy.episodes.arrivals import Arrivals


def test_arrival_counters_keep_the_most_recent_episodes_only():
    arrivals = Arrivals(size=3)
    assert [arrivals.next("a") for _ in range(3)] == [0, 1, 2]
    assert [arrivals.next("b"), arrivals.next("c"), arrivals.next("a")] == [0, 0, 3]
    assert arrivals.next("d") == 0  # a fourth episode: b, the least recently used, goes
    assert [arrivals.next("a"), arrivals.next("c"), arrivals.next("d")] == [4, 1, 1]
    assert not arrivals.served("b")
    assert arrivals.next("b") == 0  # forgotten, so it starts again
    assert arrivals.next(None) == 0  # untagged calls count like an episode of their own


def _live_calls(episode_id: str) -> int:
    """This test's calls still alive (a call another test's proxy still holds, such as one
    a held upstream has not answered, is not this test's to count)."""
    from tracetap.proxy.call.driver import ModelCall

    return sum(1 for o in gc.get_objects()
               if isinstance(o, ModelCall) and o.episode_id == episode_id)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the call's life, not storage
@pytest.mark.parametrize("stream", [True, False])
def test_a_finished_call_is_freed_at_once_not_by_the_cyclic_collector(proxy, stream):
    """A call holds its context-sized buffers (the request, its payload, the first chunk
    with the prompt's ids); serve raises the cyclic collector's threshold to 50,000
    allocations, so a call kept alive by a reference cycle (the relay pointing back at
    its call) stays in memory for many turns: at 60k context that doubled the RSS and
    faulted 400 fresh pages a turn. With the cyclic collector off, no call outlives its
    request."""
    client = openai.OpenAI(base_url=proxy.episode_url("freed"), api_key="x")
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            reply = client.chat.completions.create(
                model="mock", messages=[{"role": "user", "content": "hi"}], stream=stream)
            if stream:
                assert "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
        assert len(proxy.calls("freed")) == 3
        proxy.loop.run(asyncio.sleep(0.05))  # the metrics' call_soon has run
        assert _live_calls("freed") == 0
    finally:
        gc.enable()
