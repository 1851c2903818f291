"""The lineage tree and annotations in a real Chromium (Playwright driving Debian's
``chromium``): an orchestrator's lineages (a one-shot title call, the main agent, a
summariser and a sub-agent it started) drawn as a collapsible tree, a sub-agent episode
registered with it as parent linked both ways; a label, a comment and a corrected reward
made with the keyboard alone, shown escaped, stored with the session as author, the original reward
kept; a token span on a call; and what an agent's episode key cannot do.

One module-scoped proxy in front of the mock engine; every call goes through it with the
real ``openai`` SDK. Fails in CI (env CI) when chromium or Playwright is missing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from helpers.chromium import Page, expect, launched
from helpers.http import fetch, finish, register, request_json
from helpers.servers import Proxy
from helpers.viewer_site import XSS_TEXT, serving

TOKEN = "annotations-test-admin-token"
UI = "/tracetap/ui"
MODEL = "mock-model"
SHOTS = os.environ.get("TRACETAP_UI_SHOTS")  # docs/ui: the screenshots docs/ui.md shows


@dataclass
class Site:
    proxy: Proxy
    url: str
    orch_key: str
    explorer_call: str = ""


def _call(client: openai.OpenAI, system: str, user: str, lineage: str | None = None,
          parent: str | None = None) -> str:
    headers = {}
    if lineage:
        headers["X-Tracetap-Lineage"] = lineage
    if parent:
        headers["X-Tracetap-Parent"] = parent
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": system},
                               {"role": "user", "content": user}], extra_headers=headers)
    return reply.id


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Iterator[Site]:
    with serving(tmp_path_factory.mktemp("annotations"), TOKEN) as (proxy, _):
        created = register(proxy, "orch", task_id="orch-task")
        client = openai.OpenAI(base_url=created["base_url"], api_key=created["api_key"],
                               max_retries=0)
        _call(client, "Write a five-word title.", "the task")  # one-shot, no header
        _call(client, "You orchestrate.", "fix the bug", lineage="main")
        _call(client, "You orchestrate.", "fix the bug, turn 2", lineage="main")
        _call(client, "Summarise the conversation so far.", "the turns")  # one-shot
        _call(client, "You explore.", "find the file", lineage="explorer", parent="main")
        _call(client, "You explore.", "find it, turn 2", lineage="explorer", parent="main")
        child = register(proxy, "orch-child", task_id="child-task", parent="orch")
        _call(openai.OpenAI(base_url=child["base_url"], api_key=child["api_key"],
                            max_retries=0), "You are a sub-agent.", "look")
        finish(proxy, "orch", 1.0, outcome="solved")
        finish(proxy, "orch-child", 0.0, outcome="failed")
        proxy.flush()
        yield Site(proxy, proxy.url + UI, created["api_key"])


@pytest.fixture(scope="module")
def browser(site):
    with launched() as chromium:  # after the site (helpers.chromium says why)
        yield chromium


@pytest.fixture(scope="module")
def session_state(browser, site) -> dict:
    context = browser.new_context()
    page = context.new_page()
    page.goto(site.url + "/")
    page.fill("#token", TOKEN)
    page.click("button[type=submit]")
    expect(page.locator("h1")).to_have_text("Episodes")
    state = context.storage_state()
    context.close()
    return state


@pytest.fixture
def page(browser, session_state) -> Iterator[Page]:
    context = browser.new_context(storage_state=session_state,
                                  viewport={"width": 1280, "height": 900})
    page = context.new_page()
    yield page
    context.close()


def _admin(site: Site, method: str, path: str, body=None, token: str = TOKEN):
    return request_json(method, site.proxy.url + path, body, token=token)


def _kinds(scope) -> list[str]:
    return scope.locator(":scope > li.lineage > details > summary .lineage-kind").all_inner_texts()


def test_the_tree_nests_the_sub_agent_and_links_episodes_both_ways(page, site):
    page.goto(site.url + "/episodes/orch")
    tree = page.locator("#lineages ul.lineage-tree").first
    assert _kinds(tree) == ["title", "main"]  # in order of their first call
    main = tree.locator(":scope > li.lineage").nth(1)
    nested = main.locator(":scope > details > ul.lineage-tree")
    assert _kinds(nested) == ["summariser", "sub-agent"]  # started while main ran
    expect(nested.locator("code")).to_have_text("explorer")
    expect(nested.locator("ol.lineage-calls a")).to_have_count(3)
    expect(main.locator(":scope > details > ol.lineage-calls a")).to_have_count(2)
    # Collapsible from the keyboard: the main lineage's summary, Enter.
    main.locator(":scope > details > summary").focus()
    page.keyboard.press("Enter")
    expect(nested).to_be_hidden()
    page.keyboard.press("Enter")
    expect(nested).to_be_visible()
    # Parent → child episode, and back up.
    page.locator("#child-episodes a", has_text="orch-child").click()
    expect(page.locator("h1")).to_have_text("orch-child")
    expect(page.locator("#parent-episode")).to_contain_text("orch-task")
    page.locator("#lineages ol.lineage-calls a").first.click()  # its call: parent episode
    expect(page.locator("#call-lineage")).to_contain_text("its episode is a sub-agent of orch")
    page.go_back()
    page.locator("#parent-episode a[rel=up]").click()
    expect(page.locator("h1")).to_have_text("orch")
    expect(page.locator("#tree-h")).to_contain_text("4 conversations, 1 sub-agent episode")
    if SHOTS:
        page.locator("#lineages").screenshot(path=Path(SHOTS) / "lineages.png")


def test_label_comment_and_corrected_reward_by_keyboard_escaped_and_kept_apart(page, site):
    page.goto(site.url + "/episodes/orch")
    page.locator("#note-label").focus()
    page.keyboard.type("bad")
    page.keyboard.press("Tab")
    expect(page.locator("#note-comment")).to_be_focused()
    page.keyboard.type(XSS_TEXT)
    page.keyboard.press("Tab")
    expect(page.locator("#note-reward")).to_be_focused()
    page.keyboard.type("0.25")
    page.keyboard.press("Tab")
    expect(page.locator("#note-save")).to_be_focused()
    page.keyboard.press("Enter")
    page.wait_for_url("**/episodes/orch#annotations")
    row = page.locator("table.notes tr.note").last
    expect(row.locator(".note-label")).to_have_text("bad")
    expect(row.locator(".note-comment")).to_have_text(XSS_TEXT)  # as text, not markup
    expect(row).to_contain_text("viewer session")
    expect(page.locator("#corrected-reward")).to_contain_text("original 1.0")
    expect(page.locator("#corrected-reward")).to_contain_text("corrected 0.25")
    expect(page.locator("#reward")).to_have_text("reward 1.0")  # the heading keeps both
    expect(page.locator("#corrected-badge")).to_have_text("corrected 0.25")
    assert page.evaluate("window.__xss") is None
    if SHOTS:
        page.locator("#annotations").screenshot(path=Path(SHOTS) / "annotations.png")
    status, stored = _admin(site, "GET", "/tracetap/annotations?episode=orch")
    assert status == 200
    mine = [a for a in stored["annotations"] if a["label"] == "bad"]
    assert len(mine) == 1 and mine[0]["corrected_reward"] == 0.25
    assert mine[0]["author"].startswith("viewer session ") and mine[0]["source"] == "viewer"
    _, episode = _admin(site, "GET", "/tracetap/episodes/orch")
    assert episode["reward"] == 1.0  # the original, never overwritten


def test_a_token_span_on_a_call_and_a_span_past_the_tokens_refused(page, site):
    page.goto(site.url + "/episodes/orch")
    page.locator("#lineages ol.lineage-calls a").nth(4).click()  # the explorer's first
    call_url = page.url
    lineage = page.locator("#call-lineage")  # the call's place in the tree, and its parent
    expect(lineage).to_contain_text("sub-agent explorer, call 1 of 2; started by the main")
    lineage.locator("a[rel=up]").click()
    expect(page.locator("#call-lineage")).to_contain_text("main main, call 1 of 2")
    expect(page.locator("#call-lineage a.lineage-child")).to_have_text(
        ["summariser", "sub-agent explorer"])
    page.go_back()
    expect(page.locator("details.note-form")).to_have_attribute("open", "")  # none yet: open
    page.fill("#note-label", "loops")
    page.fill("#note-choice", "0")
    page.fill("#note-start", "0")
    page.fill("#note-end", "2")
    page.click("#note-save")
    row = page.locator("table.notes tr.note")
    expect(row).to_have_count(1)
    expect(row).to_contain_text("choice 0, tokens 0\u20131")
    page.goto(call_url)
    page.locator("details.note-form > summary").click()  # closed once there is one
    page.fill("#note-label", "x")
    for field, value in (("#note-choice", "0"), ("#note-start", "0"), ("#note-end", "99999")):
        page.fill(field, value)
    page.click("#note-save")
    expect(page.locator("main")).to_contain_text("completion tokens: the span must end")
    page.goto(site.url + "/episodes/orch")  # the episode lists its calls' spans too
    expect(page.locator("table.notes")).to_contain_text("tokens 0\u20131")


def test_an_episode_key_cannot_write_or_read_annotations(site):
    key = site.orch_key
    before = _admin(site, "GET", "/tracetap/annotations?episode=orch")[1]["annotations"]
    assert _admin(site, "POST", "/tracetap/annotations", {"episode": "orch", "label": "good",
                                                          "corrected_reward": 1.0},
                  token=key)[0] == 403
    assert _admin(site, "GET", "/tracetap/annotations?episode=orch", token=key)[0] == 403
    form = b"episode=orch&label=good&corrected_reward=1"
    status, _ = fetch("POST", site.url + "/annotations", form, token=key,
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 403
    # The admin token from another site's page (a forged form): refused too.
    status, _ = fetch("POST", site.url + "/annotations", form, token=TOKEN,
                      headers={"Content-Type": "application/x-www-form-urlencoded",
                               "Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"})
    assert status == 403
    assert _admin(site, "GET", "/tracetap/annotations?episode=orch")[1]["annotations"] == before


def test_the_admin_api_stores_with_its_author_and_enforces_limits(site):
    status, made = _admin(site, "POST", "/tracetap/annotations",
                          {"episode": "orch-child", "label": "<b>odd</b>", "author": "alice"})
    assert status == 201 and made["author"] == "api: alice" and made["target"] == "episode"
    status, error = _admin(site, "POST", "/tracetap/annotations",
                           {"episode": "orch-child", "comment": "y" * 4001})
    assert status == 400 and "longer than 4000" in error["error"]["message"]
    status, error = _admin(site, "POST", "/tracetap/annotations",
                           {"episode": "orch-child", "comment": "z" * 20_000})
    assert status == 413 and error["error"]["code"] == "body_too_large"
    status, error = _admin(site, "POST", "/tracetap/annotations",
                           {"episode": "orch-child", "label": "x", "bogus": 1})
    assert status == 400
    status, error = _admin(site, "POST", "/tracetap/annotations", {"episode": "nope",
                                                                   "label": "x"})
    assert status == 404
    listed = _admin(site, "GET", "/tracetap/annotations?episode=orch-child")[1]
    assert [a["label"] for a in listed["annotations"]] == ["<b>odd</b>"]
    raw = fetch("GET", site.url + "/episodes/orch-child", token=TOKEN)[1].decode()
    assert "&lt;b&gt;odd&lt;/b&gt;" in raw and "<b>odd</b>" not in raw
    assert json.loads(fetch("GET", site.proxy.url + "/tracetap/annotations?episode=orch",
                            token=None)[1] or b"{}").get("annotations") is None


@pytest.mark.parametrize("path", ["/episodes/orch", "/episodes/orch-child"])
def test_at_390_px_the_tree_and_the_form_fit(browser, session_state, site, path):
    context = browser.new_context(storage_state=session_state,
                                  viewport={"width": 390, "height": 844})
    try:
        narrow = context.new_page()
        narrow.goto(site.url + path)
        expect(narrow.locator("#lineages")).to_be_visible()
        assert narrow.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    finally:
        context.close()


def test_the_viewers_selector_pages_take_label(site):
    """The variants and harnesses pages read selectors as compare does: label= works there
    (an answer, never a server error)."""
    status, body = fetch("GET", site.url + "/harnesses?where=label%3Dbad", token=TOKEN)
    assert status == 200, body[:300]
    status, body = fetch("GET", site.url + "/variants?baseline=label%3Dbad"
                         "&candidate=label%3Dnull&unpaired=yes", token=TOKEN)
    assert status in (200, 400) and b"Internal Server Error" not in body, body[:300]
