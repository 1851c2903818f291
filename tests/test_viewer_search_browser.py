"""The viewer's round-2 pages in a real Chromium (Playwright driving Debian's ``chromium``):
search, a long episode's collapsed calls, the 390-px layout, sorted groups, the Tokens
columns, charts and a failed call's page.

One module-scoped proxy in front of the mock engine; every call goes through it with the
real ``openai`` SDK, so what the search finds is what the proxy's writer indexed.
Fails in CI (env CI) when chromium or Playwright is missing; skipped only outside CI.
``TRACETAP_UI_SHOTS=docs/ui`` also writes the screenshots docs/ui.md shows.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from helpers.chromium import Page, expect, launched
from helpers.http import finish, register
from helpers.servers import Proxy
from helpers.viewer_site import serving

TOKEN = "search-test-admin-token"
UI = "/tracetap/ui"
MODEL = "mock-model"
LONG_CALLS = 40
SHOTS = os.environ.get("TRACETAP_UI_SHOTS")


@dataclass
class Site:
    proxy: Proxy
    url: str
    usage: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # prompt, completion


def _client(created: dict) -> openai.OpenAI:
    return openai.OpenAI(base_url=created["base_url"], api_key=created["api_key"],
                         max_retries=0)


def _tool_turn(site: Site, episode_id: str, context: str, observation: str) -> None:
    """Two calls: a task, then the tool's output after the model's tool call."""
    created = register(site.proxy, episode_id, group_id=f"grp-{context}", task_id="fix",
                        harness={"name": f"agent-{context}", "config": {"context": context}},
                        metadata={"batch": "search-test"})
    client = _client(created)
    first = [{"role": "system", "content": "You are careful. Zebracorn rules apply."},
             {"role": "user", "content": "fix the failing test"}]
    usage = site.usage.setdefault(episode_id, [])
    reply = client.chat.completions.create(model=MODEL, messages=first)
    usage.append((reply.usage.prompt_tokens, reply.usage.completion_tokens))
    second = [*first, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "shell",
                                                      "arguments": '{"cmd": "pytest"}'}}]},
              {"role": "tool", "tool_call_id": "t1", "content": observation}]
    reply = client.chat.completions.create(model=MODEL, messages=second)
    usage.append((reply.usage.prompt_tokens, reply.usage.completion_tokens))


def _long_episode(site: Site) -> None:
    """LONG_CALLS append-only calls, the 20th of them failed upstream."""
    client = _client(register(site.proxy, "long", task_id="long-task",
                               harness={"name": "agent-long", "config": {"context": "full"}}))
    messages = [{"role": "user", "content": "start"}]
    usage = site.usage.setdefault("long", [])
    for k in range(LONG_CALLS):
        if k == 20:
            with pytest.raises(openai.InternalServerError):
                client.chat.completions.create(model=MODEL, messages=messages,
                                               extra_body={"mock_status": 500})
            continue
        reply = client.chat.completions.create(model=MODEL, messages=messages)
        usage.append((reply.usage.prompt_tokens, reply.usage.completion_tokens))
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"observation {k}"}]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Iterator[Site]:
    with serving(tmp_path_factory.mktemp("search"), TOKEN) as (proxy, _):
        s = Site(proxy, proxy.url + UI)
        _tool_turn(s, "needle", "full", "FileNotFoundError: /tmp/conftest.py")
        _tool_turn(s, "hay", "summarised", "No space left on device")
        _tool_turn(s, "hay-2", "summarised", "all 12 tests passed")
        _long_episode(s)
        for episode_id, reward in (("needle", 1.0), ("hay", 0.0), ("hay-2", 0.5),
                                   ("long", 1.0)):
            finish(proxy, episode_id, reward, outcome="solved" if reward else "failed")
        proxy.flush()
        yield s


@pytest.fixture(scope="module")
def browser(site):
    with launched() as chromium:
        yield chromium


def _page(browser, width: int, height: int) -> Page:
    context = browser.new_context(viewport={"width": width, "height": height},
                                  extra_http_headers={"Authorization": f"Bearer {TOKEN}"})
    return context.new_page()


@pytest.fixture
def page(browser) -> Iterator[Page]:
    page = _page(browser, 1280, 900)
    yield page
    page.context.close()


@pytest.fixture
def narrow(browser) -> Iterator[Page]:
    page = _page(browser, 390, 844)
    yield page
    page.context.close()


def _shoot(page: Page, name: str, full_page: bool = False) -> None:
    if SHOTS:
        page.screenshot(path=Path(SHOTS) / name, full_page=full_page)


def test_search_finds_tool_output_and_narrows_by_config_model_and_metadata(page, site):
    page.goto(site.url + "/")
    page.click(".top nav >> text=Search")
    page.fill("#s-q", "FileNotFoundError")
    page.click("form.search-form button[type=submit]")
    assert "q=FileNotFoundError" in page.url  # the search is a link
    ids = page.locator("table.results td.id a")
    expect(ids).to_have_text(["needle"])
    snippet = page.locator("table.results td.snippet")
    expect(snippet.locator("mark")).to_have_text("FileNotFoundError")
    expect(snippet).to_contain_text("/tmp/conftest.py")
    _shoot(page, "search.png")
    snippet.locator("a").click()  # to the call whose tool output matched
    expect(page.locator(".turns")).to_contain_text("FileNotFoundError: /tmp/conftest.py")

    page.goto(site.url + "/search?q=zebracorn")  # in every episode's system prompt
    expect(ids).to_have_count(3)
    page.fill("#s-where", "config.context=summarised, meta.batch=search-test")
    page.click("form.search-form button[type=submit]")
    assert sorted(ids.all_inner_texts()) == ["hay", "hay-2"]
    page.goto(site.url + '/search?q="no space left"')
    expect(ids).to_have_text(["hay"])
    page.goto(site.url + "/search?q=zebracorn+-device&where=config.context%3Dsummarised")
    expect(ids).to_have_text(["hay-2"])
    page.goto(site.url + f"/search?q=zebracorn&model={MODEL}&harness=agent-full")
    expect(ids).to_have_text(["needle"])
    page.goto(site.url + "/search?q=nosuchwordanywhere")
    expect(page.locator("main")).to_contain_text("No episode matches")
    page.goto(site.url + "/search?where=context%3Dfull")
    expect(page.locator("main")).to_contain_text("config.NAME=VALUE")  # a named 400


def test_search_finds_an_upstreams_error(page, site):
    page.goto(site.url + "/search?q=injected")  # the mock engine's 500: "Injected failure"
    expect(page.locator("table.results td.id a")).to_have_text(["long"])


def test_a_long_episode_lists_first_last_and_failed_calls_and_shows_tokens_at_once(page, site):
    page.goto(site.url + "/episodes/long")
    rows = page.locator("table.calls tbody tr")
    # first, gap, the failed one, gap, last
    expect(rows).to_have_count(5)
    expect(rows.nth(2)).to_have_class("failed")
    gaps = page.locator("table.calls tr.gap")
    assert gaps.all_inner_texts()[0].startswith("19 more calls")
    assert gaps.all_inner_texts()[1].startswith("18 more calls")
    expect(rows.nth(2).locator(".badge.failed")).to_have_text("HTTP 500")
    top = page.locator("#toks").bounding_box()["y"]
    assert top < 1600, f"the tokens start {top:.0f} px down"
    _shoot(page, "episode-long.png", full_page=False)
    page.click("text=list all")
    expect(rows).to_have_count(LONG_CALLS)
    rows.nth(20).locator("a").first.click()
    expect(page.locator("#call-status")).to_have_text("HTTP 500")
    expect(page.locator("#call-error")).to_contain_text("HTTP 500")
    expect(page.locator("#call-error")).to_contain_text("Injected failure")


def test_episodes_show_trajectory_and_trained_tokens_not_summed_usage(page, site):
    page.goto(site.url + "/?q=long")
    header = page.locator("table.episodes thead")
    expect(header).to_contain_text("Trajectory")
    expect(header).to_contain_text("Trained")
    cells = page.locator("table.episodes tbody tr").first.locator("td.num")
    usage = site.usage["long"]
    trajectory = max(p + c for p, c in usage)
    trained = sum(c for _, c in usage)
    texts = cells.all_inner_texts()
    assert f"{trajectory:,}" in texts and f"{trained:,}" in texts
    summed = sum(p + c for p, c in usage)
    assert f"{summed:,}" not in texts
    expect(page.locator(".charts")).to_have_count(0)  # one episode: no distribution
    page.goto(site.url + "/")
    img = page.locator(".charts img")
    expect(img).to_have_attribute("loading", "lazy")
    expect(img).to_have_js_property("complete", True)


def test_groups_sort_by_mean_reward_and_id(page, site):
    page.goto(site.url + "/groups")
    page.click("table.groups th >> text=Rewards")
    assert "sort=reward" in page.url
    groups = page.locator("table.groups td.id a")
    expect(groups).to_have_text(["grp-full", "grp-summarised"])  # mean 1.0, then 0.25
    page.click("table.groups th >> text=Rewards")
    expect(groups).to_have_text(["grp-summarised", "grp-full"])
    page.goto(site.url + "/groups?sort=group&order=asc")
    expect(groups).to_have_text(["grp-full", "grp-summarised"])


_BROKEN_WORDS = """() => {
  // A text of one word (no space or dash) laid out on more than one line: broken inside.
  const out = [];
  for (const el of document.querySelectorAll('.top nav a, table th, table td')) {
    const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      const text = node.textContent.trim();
      if (!text || /[\\s\\-\\u2013]/.test(text)) continue;
      const range = document.createRange();
      range.selectNodeContents(node);
      const tops = new Set([...range.getClientRects()].map(r => Math.round(r.top)));
      if (tops.size > 1) out.push(text);
    }
  }
  return out;
}"""


@pytest.mark.parametrize("path", ["/", "/search?q=zebracorn", "/groups", "/episodes/long"])
def test_at_390_px_nothing_overflows_and_no_word_breaks(narrow, site, path):
    narrow.goto(site.url + path)
    assert narrow.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    assert narrow.evaluate(_BROKEN_WORDS) == []
    for link in narrow.locator(".top nav a").all():
        assert link.evaluate("a => a.getClientRects().length") == 1
    if path == "/search?q=zebracorn":
        _shoot(narrow, "search-390.png", full_page=True)
    if path == "/":
        _shoot(narrow, "episodes-390.png")
