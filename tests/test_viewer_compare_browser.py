"""Compare pages, the coverage heatmap and low-probability navigation in a real Chromium.

Reuses the viewer tests' captured site (tests/helpers/viewer_site.py: the demo's episodes
through a real proxy), plus a batch of finished episodes of two harness variants on the
same tasks for the variant comparison and the heatmap (``variants_site``). Fails, never skips, in CI
without chromium.
"""

# ruff: noqa: F811 - the tests take helpers.viewer_site's fixtures by name

from __future__ import annotations

import itertools
import math
import re

import pytest

# Importing the bench skips this module without chromium or Playwright (fails in CI).
from helpers.viewer_site import (  # noqa: F401 - fixtures, used by name
    UI,
    Page,
    browser,
    compare_in_thread,
    expect,
    of_variant,
    page,
    session_state,
    site,
    variants_site,
)

LN_P = math.log(0.2)  # the page's default threshold
def _no_overflow(page: Page) -> None:
    width = page.evaluate("() => document.scrollingElement.scrollWidth")
    assert width <= page.viewport_size["width"], f"page is {width} px wide"


def _tokens(row: dict) -> list[int]:
    return row["prompt_ids"] + row["response_ids"]


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_ticking_two_episodes_compares_them_side_by_side(page, site):
    first, second = of_variant(site, "append-only")[0], of_variant(site, "context-rewrite")[0]
    page.goto(site.url + "/?limit=100")
    page.locator(f"input[name=e][value='{first}']").check()
    page.locator("#compare-ticked").click()
    expect(page.locator(".error")).to_contain_text(
        "tick exactly two episodes to compare (1 ticked)")
    page.go_back()
    page.locator(f"input[name=e][value='{first}']").check()
    page.locator(f"input[name=e][value='{second}']").check()
    page.locator("#compare-ticked").click()
    assert re.search(r"/compare\?a=[^&]+&b=", page.url)
    expect(page.locator("h1")).to_have_text("Compare episodes")
    a, b = _tokens(site.rows[first][0]), _tokens(site.rows[second][0])
    common = _common(a, b)
    expect(page.locator("#diverge-at")).to_have_text(f"{common:,}")
    expect(page.locator(".cmp-diverge")).to_contain_text(f"share their first {common:,} tokens")
    # the first diverging token is outlined on both sides, and it is token `common`
    for side in ("a", "b"):
        marked = page.locator(f"#cmp-toks-{side} .t.dv")
        expect(marked).to_have_count(1)
        assert marked.get_attribute("title") == f"token {common}"
    # the conversations are aligned message by message; the first difference is marked
    pairs = page.locator(".cmp-pair")
    assert pairs.count() >= 2
    expect(page.locator("#first-diff")).to_have_count(1)
    assert "first difference" in page.locator("#first-diff .cmp-n").inner_text()
    same = page.locator(".cmp-pair:not(.differs)")
    assert same.count() >= 1  # both start with the same system prompt
    page.locator(".cmp-head a", has_text=first).click()
    expect(page.locator("h1")).to_have_text(first)


def test_two_rows_of_one_episode_part_where_the_split_box_says(page, site):
    (episode_id,) = of_variant(site, "context-rewrite")
    first, second = site.rows[episode_id]
    page.goto(f"{site.url}/episodes/{episode_id}?t=1")
    page.locator("#split-compare").click()  # the split box links to the two side by side
    assert page.url.endswith(f"/compare?a={episode_id}&b={episode_id}&ta=0&tb=1")
    common = _common(_tokens(first), _tokens(second))
    expect(page.locator("#diverge-at")).to_have_text(f"{common:,}")
    page.locator(".cmp-diverge a", has_text="show in B").click()
    expect(page.locator("#tok-detail")).to_contain_text(re.compile(rf"position{common}id"))
    expect(page.locator(".split-box h3")).to_contain_text("Why row 2 split")
    expect(page.locator(".split-box")).to_contain_text(f"It shares its first {common} tokens")


def test_two_calls_compare_their_prompts_and_completions(page, site):
    episode_id = of_variant(site, "append-only")[0]
    page.goto(f"{site.url}/episodes/{episode_id}")
    calls = page.locator("table.calls tbody td:first-child a")
    ids = [h.rsplit("/", 1)[1] for h in calls.evaluate_all("xs => xs.map(a => a.href)")]
    assert len(ids) >= 2
    page.goto(f"{site.url}/compare/calls?a={ids[0]}&b={ids[1]}")
    expect(page.locator("h1")).to_have_text("Compare calls")
    # append-only: the second call's prompt extends the first call's prompt and reply
    expect(page.locator(".cmp-diverge")).to_contain_text("(A ends there)")
    shown = page.locator(".cmp-head").first.locator("dd").last.inner_text()
    assert page.locator("#diverge-at").inner_text() == shown
    page.goto(f"{site.url}/compare/calls?a={ids[0]}&b=nope")
    expect(page.locator(".error")).to_contain_text("no call 'nope'")


def test_variant_comparison_shows_delta_its_interval_and_the_flipped_tasks(page, variants_site):
    site = variants_site
    page.goto(site.url + "/variants")
    page.fill("#v-baseline", "harness=base-h")
    page.fill("#v-candidate-1", "harness=cand-h")
    page.fill("#v-success", "solved")
    page.click("#variants-form button[type=submit]")
    expected = compare_in_thread(site).candidates[0]
    assert expected.delta == pytest.approx(0.2)  # (2 fixed - 1 broken) / 5 tasks
    delta = page.locator("#variants td.delta")
    assert float(delta.get_attribute("data-delta")) == pytest.approx(expected.delta)
    expect(delta).to_have_text(f"{expected.delta:+.3f}")
    low, high = expected.interval
    expect(page.locator("#variants td.interval")).to_contain_text(f"[{low:+.3f}, {high:+.3f}]")
    fixed = page.locator("#fixed-1 tbody tr")
    expect(fixed).to_have_count(2)
    assert sorted(fixed.locator("td:first-child").all_inner_texts()) == ["t1", "t2"]
    expect(page.locator("#broken-1 tbody td:first-child")).to_have_text(["t3"])
    # links into the episodes of each side, and the two side by side
    broken = page.locator("#broken-1 tbody tr")
    assert broken.locator("td:nth-child(2) a").get_attribute("href") == (
        f"{UI}/episodes/v-base-h-t3")
    broken.locator("a", has_text="compare").click()
    expect(page.locator(".cmp-head a").first).to_contain_text("v-base-h-t3")
    page.goto(site.url + "/variants?baseline=harness=base-h&candidate=harness=nothing")
    expect(page.locator("#variants-error")).to_contain_text("matches none")
    page.goto(site.url + "/variants?baseline=nokey&candidate=harness=x")
    expect(page.locator(".error")).to_contain_text("is not KEY=VALUE")


def test_coverage_heatmap_counts_level_pairs_and_shows_the_unseen(page, variants_site):
    site = variants_site
    page.goto(site.url + "/harnesses?where=meta.batch%3Dh29&factor=ctx,retries"
              "&success=solved")
    expect(page.locator("#coverage-summary")).to_contain_text("10 finished episodes")
    grid = page.locator("#hm-ctx-retries")
    # base-h always ran retries=1 and cand-h retries=2: the crossed pairs never ran
    expect(grid.locator("thead th")).to_have_text(["", "1", "2"])
    expect(grid.locator("tbody th")).to_have_text(["base", "cand"])
    cells = grid.locator("tbody td")
    expect(cells).to_have_text([re.compile(r"40%\s+n=5"), "never ran", "never ran",
                                re.compile(r"60%\s+n=5")])
    assert "hm-never" in cells.nth(1).get_attribute("class")
    expect(page.locator("#levels tbody tr")).to_have_count(4)
    page.locator("#levels a", has_text="against base").click()
    expect(page.locator("#variants td.delta")).to_have_count(1)


def _low_positions(row: dict) -> list[int]:
    start = len(row["prompt_ids"])
    return [start + i for i, (m, lp) in enumerate(zip(row["response_mask"],
                                                      row["response_logprobs"]))
            if m and lp < LN_P]


def test_low_probability_tokens_are_listed_and_reached_by_keys_and_buttons(page, site):
    episode_id = of_variant(site, "append-only")[0]
    row = site.rows[episode_id][0]
    lows = _low_positions(row)
    assert len(lows) >= 2, "the mock engine samples some unlikely tokens"
    page.goto(f"{site.url}/episodes/{episode_id}?n=64")
    expect(page.locator("#lowp-count strong")).to_have_text(f"{len(lows):,}")
    # the k lowest: lowest first, each a link that selects the token in its window
    trained = [(lp, len(row["prompt_ids"]) + i) for i, (m, lp) in
               enumerate(zip(row["response_mask"], row["response_logprobs"])) if m]
    lowest = sorted(trained)[:10]
    links = page.locator("#lowest tbody td:first-child a")
    expect(links).to_have_text([f"{pos:,}" for _, pos in lowest])
    links.nth(0).click()
    assert f"sel={lowest[0][1]}" in page.url
    expect(page.locator("#toks .t.sel")).to_have_count(1)
    expect(page.locator("#tok-detail")).to_contain_text(
        re.compile(rf"position{lowest[0][1]}id"))
    # keys: n and p walk the low tokens in order, across windows of 64 tokens
    page.goto(f"{site.url}/episodes/{episode_id}?n=64")
    page.locator("#toks").focus()
    page.keyboard.press("Home")
    detail = page.locator("#tok-detail")
    shown = min(len(lows), 4)
    for position in lows[:shown]:
        page.keyboard.press("n")  # within the window, or on to the one that holds it
        expect(detail).to_contain_text(re.compile(rf"position{position}id"))
        expect(page.locator("#toks .t.sel")).to_have_count(1)
    page.locator("#lowp-prev").click()
    expect(detail).to_contain_text(re.compile(rf"position{lows[shown - 2]}id"))
    # the strip over the whole row: one link per stretch with low tokens, to the first
    firsts = page.locator(".lowp-strip a").evaluate_all(
        "xs => xs.map(a => Number(new URL(a.href.baseVal || a.getAttribute('href'), "
        "location.href).searchParams.get('sel')))")
    assert firsts[0] == lows[0] and set(firsts) <= set(lows)
    # each turn's mean logprob, as the exported row's logprobs give it
    turns = page.locator("#turn-means tbody tr")
    expect(turns).to_have_count(row["num_turns"])


def test_the_palette_is_colour_blind_safe_and_the_legend_shows_it(page, site):
    episode_id = of_variant(site, "append-only")[0]
    page.goto(f"{site.url}/episodes/{episode_id}")
    legend = page.locator(".legend .t.s")
    expect(legend).to_have_count(5)
    colours = legend.evaluate_all("xs => xs.map(x => getComputedStyle(x).backgroundColor)")

    def luminance(css: str) -> float:
        r, g, b = (int(v) / 255 for v in re.findall(r"\d+", css)[:3])
        lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (r, g, b)]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    # pale blue = likely to dark orange = unlikely, each band darker than the one before
    # by a visible step: the bands read apart by lightness alone (in grey, and for every
    # colour-vision deficiency), and the hue runs blue to orange, never red against green
    lum = [luminance(c) for c in colours]
    steps = [(x + 0.05) / (y + 0.05) for x, y in itertools.pairwise(lum)]
    assert all(step >= 1.15 for step in steps), (colours, steps)
    rgb = [[int(v) for v in re.findall(r"\d+", c)[:3]] for c in colours]
    assert all(b > r for r, _, b in rgb[:2]) and all(r > b for r, _, b in rgb[2:])
    # the trained tokens in the view wear the legend's colours
    used = page.locator("#toks .t.s:not(.nl)").evaluate_all(
        "xs => [...new Set(xs.map(x => getComputedStyle(x).backgroundColor))]")
    assert set(used) <= set(colours)


@pytest.mark.parametrize("path", [
    "/compare?a={a}&b={b}", "/variants?baseline=harness%3Dbase-h&candidate=harness%3Dcand-h"
    "&success=solved", "/harnesses?where=meta.batch%3Dh29&factor=ctx,retries",
    "/episodes/{a}"])
def test_new_pages_fit_a_390_px_phone(browser, session_state, variants_site, path):
    site = variants_site
    context = browser.new_context(storage_state=session_state,
                                  viewport={"width": 390, "height": 844})
    page = context.new_page()
    problems: list[str] = []  # a CSP refusal or a script error shows up on the console
    page.on("console", lambda m: m.type in ("error", "warning") and problems.append(m.text))
    page.on("pageerror", lambda e: problems.append(str(e)))
    a, b = of_variant(site, "append-only")[0], of_variant(site, "context-rewrite")[0]
    page.goto(site.url + path.format(a=a, b=b))
    expect(page.locator("h1")).to_be_visible()
    _no_overflow(page)
    if path.startswith("/compare"):
        heads = page.locator(".cmp-head")
        first, second = heads.nth(0).bounding_box(), heads.nth(1).bounding_box()
        assert second["y"] >= first["y"] + first["height"]  # stacked, not squeezed
    if path.startswith("/episodes"):
        page.locator("#lowp").scroll_into_view_if_needed()
        assert page.locator(".lowp-strip").bounding_box()["width"] <= 390
    assert problems == []
    context.close()


def test_hostile_content_compared_is_shown_as_text_and_never_runs(page, site):
    reply = page.goto(f"{site.url}/compare?a=hostile&b=alts")
    assert "unsafe-inline" not in reply.headers["content-security-policy"]
    expect(page.locator(".cmp-pairs")).to_contain_text("<script>window.__xss = 1</script>")
    expect(page.locator(".cmp-head").first).to_contain_text("<script>window.__xss = 5</script>")
    assert page.locator("a[href^='javascript:'], img[src='x'], main script").count() == 0
    assert page.evaluate("window.__xss") is None and page.dialogs == []
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
