"""The viewer's low-probability navigation and comparison logic, without a browser.

Pages in Chromium are in test_viewer_compare_browser.py; these pin the numbers the pages
show: which tokens are low, the k lowest, each turn's mean, the strip, the first
diverging token and the aligned conversations, and the coverage heatmap's counts.
"""

from __future__ import annotations

import asyncio
import math
from array import array

import pytest

from tracetap.analysis.coverage import coverage
from tracetap.analysis.episodes import Episode
from tracetap.analysis.select import Success
from tracetap.migrations import upgrade
from tracetap.storage.engine import create_engine
from tracetap.storage.records import CallRecord, ChoiceRecord
from tracetap.storage.rows import insert_calls
from tracetap.storage.scan import Reader
from tracetap.storage.summaries import EpisodeSummary
from tracetap.viewer import compare, lowp, tokens, variants
from tracetap.viewer.conversation import Turn
from tracetap.viewer.params import BadParameter

T0 = 1_700_000_000.0


def _call(call_id: str, t: float, prompt: list[int], completion: list[int],
          logprobs: list[float]) -> CallRecord:
    choice = ChoiceRecord(index=0, finish_reason="stop", text="x", completion_ids=completion,
                          completion_logprobs=logprobs, token_source="engine")
    return CallRecord(call_id=call_id, episode_id="ep", endpoint="chat.completions",
                      t_start=t, t_first_byte=t + 0.01, t_end=t + 0.1, status="ok",
                      http_status=200, prompt_ids=prompt, prompt_tokens=len(prompt),
                      completion_tokens=len(completion), instance="i", choices=[choice])


def _row(tmp_path) -> tokens.Row:
    """Two append-only turns: prompt [1..4], turn 1 = 5 tokens, a tool output, turn 2."""
    url = f"sqlite:///{tmp_path / 'lp.db'}"
    upgrade(url)
    first = _call("a", T0, [1, 2, 3, 4], [10, 11, 12, 13, 14], [-0.01, -2.0, -0.1, -3.5, -0.2])
    second = _call("b", T0 + 1, [1, 2, 3, 4, 10, 11, 12, 13, 14, 50, 51],
                   [20, 21, 22], [-1.7, -0.05, -0.9])

    async def run():
        engine = create_engine(url)
        await insert_calls(engine, [first, second])
        await engine.dispose()
        async with Reader(url, with_bodies=False) as reader:
            return await tokens.episode_rows(reader, "ep")

    (row,), _ = asyncio.run(run())
    return row


def test_low_tokens_are_found_over_the_whole_row_and_only_among_trained(tmp_path):
    row = _row(tmp_path)
    assert row.ids.tolist() == [1, 2, 3, 4, 10, 11, 12, 13, 14, 50, 51, 20, 21, 22]
    # p < 0.2 is logprob < -1.609: positions 5 (-2.0), 7 (-3.5), 11 (-1.7); the tool
    # output (9, 10) and the prompt carry logprob 0 and are never trained: never low.
    low = lowp.summary(row, 0, 6, 0.2, 3)
    assert low.below == 3 and low.threshold == pytest.approx(math.log(0.2))
    assert [(x.position, x.logprob, x.token_id, x.turn) for x in low.lowest] == [
        (7, -3.5, 13, 1), (5, -2.0, 11, 1), (11, -1.7, 20, 2)]
    assert low.ids == [13, 11, 20]
    # the window [0, 6) holds 5; the nearest outside it: none before, 7 after
    assert (low.previous, low.next) == (None, 7)
    later = lowp.summary(row, 8, 14, 0.2, 3)
    assert (later.previous, later.next) == (7, None)
    means = [(m.number, m.call_id, m.tokens, m.below) for m in low.turns]
    assert means == [(1, "a", 5, 2), (2, "b", 3, 1)]
    assert low.turns[0].mean == pytest.approx((-0.01 - 2.0 - 0.1 - 3.5 - 0.2) / 5)
    assert low.turns[1].lowest == -1.7
    assert sum(b.below for b in low.strip) == 3 and low.peak >= 1
    assert next(b.first for b in low.strip if b.below) == 5
    assert low.strip[-1].end == row.total and low.strip[0].start == 0
    # k caps the list; a higher p finds more
    assert len(lowp.summary(row, 0, 6, 0.2, 1).lowest) == 1
    assert lowp.summary(row, 0, 6, 0.95, 3).below == 6


def test_low_token_links_open_the_window_that_holds_the_token():
    href = lowp.linker({"t": "1", "n": "64", "p": "0.3", "at": "0", "other": "x"}, 64)
    assert href(sel=130) == "?t=1&at=128&n=64&p=0.3&sel=130"
    assert lowp.window_start(2047, 2048) == 0 and lowp.window_start(2048, 2048) == 2048


@pytest.mark.parametrize("query", [{"p": "0"}, {"p": "1"}, {"p": "x"}, {"k": "many"}])
def test_bad_thresholds_are_named(query):
    with pytest.raises(BadParameter):
        lowp.options(query)


def test_options_default_and_cap():
    assert lowp.options({}) == (lowp.DEFAULT_P, lowp.DEFAULT_K)
    assert lowp.options({"p": "0.5", "k": "100000"}) == (0.5, lowp.MAX_K)


def test_first_diverging_token_and_aligned_conversations():
    a, b = array("i", [1, 2, 3, 4]), array("i", [1, 2, 9, 4, 5])
    assert compare.diverging(a, b) == 2
    assert compare.diverging(a, array("i", [1, 2, 3, 4])) is None
    assert compare.diverging(a, array("i", [1, 2, 3, 4, 5])) == 4  # a prefix: where A ends
    system, user = Turn(role="system", text="s"), Turn(role="user", text="q")
    pairs, first = compare.aligned([system, user, Turn(role="assistant", text="x")],
                                   [system, Turn(role="user", text="other")])
    assert [p.same for p in pairs] == [True, False, False] and first == 1
    assert pairs[2].b is None
    assert compare.aligned([system], [system]) == ([compare.Pair(index=0, a=system, b=system,
                                                                 same=True)], None)


def _episode(eid: str, task: str, config: dict[str, str], reward: float) -> Episode:
    summary = EpisodeSummary(id=eid, task_id=task, reward=reward, outcome=None,
                             finished_at=T0)
    return Episode(summary=summary, config=config, metadata={}, factors=dict(config))


def test_heatmap_counts_each_level_pair_and_marks_the_pairs_that_never_ran():
    episodes = [
        _episode("e1", "t1", {"ctx": "full", "retries": "1"}, 1.0),
        _episode("e2", "t1", {"ctx": "full", "retries": "1"}, 0.0),
        _episode("e3", "t2", {"ctx": "full", "retries": "2"}, 1.0),
        _episode("e4", "t2", {"ctx": "short", "retries": "1"}, 0.0),
    ]
    success = Success()
    report = coverage(episodes, success=success)
    (grid,) = variants.heatmaps(report, episodes, success)
    assert (grid.factor, grid.other, grid.rows, grid.columns) == (
        "ctx", "retries", ["full", "short"], ["1", "2"])
    cells = [[(c.episodes, c.success_rate, c.shade) for c in r] for r in grid.cells]
    assert cells == [[(2, 0.5, 2), (1, 1.0, 4)], [(1, 0.0, 0), (0, None, -1)]]
    # the never-ran cell is exactly the coverage report's unseen pair
    assert [(p.factor, p.level, p.other_factor, p.other_level) for p in report.unseen_pairs] == [
        ("ctx", "short", "retries", "2")]
