"""The interval plots in a real Chromium: per-level success with its Wilson interval on
the harnesses page, Δ_B with its bootstrap interval on the variants page. Checked
against the statistics computed here, in the SVG's numbers and where Chromium drew the
points. Screenshots go to $TRACETAP_SCREENSHOTS when it is set (for a person to look at).

Reuses test_viewer_compare_browser's batch of two harness variants on five tasks.
"""

# ruff: noqa: F811 - the tests take the other modules' fixtures by name

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.viewer_site import (  # noqa: F401 - fixtures, used by name
    browser,
    compare_in_thread,
    expect,
    page,
    session_state,
    site,
    variants_site,
)

from tracetap.analysis.stats import wilson

HARNESSES = "/harnesses?where=meta.batch%3Dh29&factor=ctx,retries&success=solved"
VARIANTS = "/variants?baseline=harness%3Dbase-h&candidate=harness%3Dcand-h&success=solved"


def _shot(page, name: str) -> None:
    where = os.environ.get("TRACETAP_SCREENSHOTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(where) / name), full_page=True)


def _drawn_fraction(page, plot: str, row) -> float:
    """Where Chromium drew the row's point, as a fraction of the plot's axis."""
    svg = page.locator(f"#{plot} svg")
    box = svg.bounding_box()
    scale = box["width"] / float(svg.get_attribute("viewBox").split()[2])
    left = float(svg.get_attribute("data-left"))
    width = float(svg.get_attribute("data-plot-w"))
    point = row.locator("circle.point").bounding_box()
    centre = (point["x"] + point["width"] / 2 - box["x"]) / scale
    low = float(svg.get_attribute("data-axis-low"))
    high = float(svg.get_attribute("data-axis-high"))
    return low + (high - low) * (centre - left) / width


def test_levels_are_plotted_with_their_wilson_intervals(page, variants_site):
    page.set_viewport_size({"width": 1100, "height": 900})
    page.goto(variants_site.url + HARNESSES)
    rows = page.locator("#level-plot g.row")
    expect(rows).to_have_count(4)
    labels = [rows.nth(i).get_attribute("data-label") for i in range(4)]
    assert labels == ["ctx=base", "ctx=cand", "retries=1", "retries=2"]
    # base-h solved t3 and t4 of five tasks, cand-h t1, t2 and t4 (the batch's rewards).
    expected = {"ctx=base": 2, "ctx=cand": 3, "retries=1": 2, "retries=2": 3}
    for i, label in enumerate(labels):
        row = rows.nth(i)
        low, high = wilson(expected[label], 5)
        assert float(row.get_attribute("data-value")) == pytest.approx(expected[label] / 5)
        assert float(row.get_attribute("data-low")) == pytest.approx(low)
        assert float(row.get_attribute("data-high")) == pytest.approx(high)
        # Drawn where the numbers say: the point at the rate, the whiskers at the interval.
        assert _drawn_fraction(page, "level-plot", row) == pytest.approx(
            expected[label] / 5, abs=0.01
        )
        line = row.locator("line.interval")
        x1, x2 = float(line.get_attribute("x1")), float(line.get_attribute("x2"))
        assert (x1, x2) == pytest.approx((200 + 424 * low, 200 + 424 * high), abs=0.01)
        expect(row.locator("title")).to_have_text(
            f"{label}: {expected[label] / 5:.3f} [{low:.3f}, {high:.3f}]"
        )
    # Beside the heatmap, and the table still says the same numbers.
    expect(page.locator("#hm-ctx-retries")).to_be_visible()
    expect(page.locator("#levels tbody tr").first).to_contain_text("0.400")
    _shot(page, "harnesses-plots.png")


def test_delta_b_is_plotted_with_its_interval_around_zero(page, variants_site):
    page.set_viewport_size({"width": 1100, "height": 900})
    page.goto(variants_site.url + VARIANTS)
    expected = compare_in_thread(variants_site).candidates[0]
    rows = page.locator("#delta-plot g.row")
    expect(rows).to_have_count(1)
    row = rows.first
    assert row.get_attribute("data-label") == "harness=cand-h"
    assert float(row.get_attribute("data-value")) == pytest.approx(expected.delta) == 0.2
    low, high = expected.interval
    assert float(row.get_attribute("data-low")) == pytest.approx(low)
    assert float(row.get_attribute("data-high")) == pytest.approx(high)
    assert _drawn_fraction(page, "delta-plot", row) == pytest.approx(0.2, abs=0.01)
    svg = page.locator("#delta-plot svg")
    # The axis is symmetric, the zero line in its middle; an interval that holds 0 is
    # neither green nor red.
    assert float(svg.get_attribute("data-axis-low")) == -float(svg.get_attribute("data-axis-high"))
    zero = float(page.locator("#delta-plot line.zero").get_attribute("x1"))
    assert zero == pytest.approx(200 + 424 / 2)
    assert low < 0 < high and row.get_attribute("class") == "row level"
    expect(page.locator("#delta-plot figcaption")).to_contain_text("Δ_B against harness=base-h")
    _shot(page, "variants-plots.png")


def test_held_out_configs_are_plotted_against_the_rest(page, variants_site):
    page.set_viewport_size({"width": 1100, "height": 900})
    page.goto(variants_site.url + HARNESSES + "&held_out=config.ctx%3Dcand")
    # cand-h (held out) solved 3 of 5, base-h 2 of 5: +0.2, with Newcombe's interval
    # from the two Wilson intervals.
    (l1, u1), (l2, u2) = wilson(3, 5), wilson(2, 5)
    low = 0.2 - ((0.6 - l1) ** 2 + (u2 - 0.4) ** 2) ** 0.5
    high = 0.2 + ((u1 - 0.6) ** 2 + (0.4 - l2) ** 2) ** 0.5
    rows = page.locator("#held-out-plot g.row")
    expect(rows).to_have_count(5)  # all, then the four levels
    first = rows.first
    assert first.get_attribute("data-label") == "all"
    assert float(first.get_attribute("data-value")) == pytest.approx(0.2)
    assert float(first.get_attribute("data-low")) == pytest.approx(low)
    assert float(first.get_attribute("data-high")) == pytest.approx(high)
    assert _drawn_fraction(page, "held-out-plot", first) == pytest.approx(0.2, abs=0.01)
    # Every level is on one side only (ctx and retries follow the harness): no difference.
    for i in range(1, 5):
        expect(rows.nth(i).locator("text.never")).to_have_text("held out or not, not both")
    expect(page.locator("#held-out-summary")).to_contain_text(
        "5 tasks ran both, mean held-out minus rest +0.200"
    )
    _shot(page, "harnesses-held-out.png")
    page.goto(variants_site.url + HARNESSES + "&held_out=config.ctx%3Dnone")
    expect(page.locator("#harnesses-error")).to_contain_text("no episode is held out")
