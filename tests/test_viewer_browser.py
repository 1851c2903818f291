"""The trace viewer in a real Chromium (Playwright driving Debian's ``chromium``).

One module-scoped proxy in front of the mock engine captures a small demo-like set of
episodes (append-only, context rewrite, a GRPO group, a failed call, top logprobs, and a
hostile agent); each test opens pages as a user would and checks what a user checks.
Skipped only when chromium (or Playwright) is missing and CI is not set.
"""

# ruff: noqa: F811 - the tests take helpers.viewer_site's fixtures by name

from __future__ import annotations

import openai
import pytest
from helpers.http import register

# Importing the bench skips this module without chromium or Playwright (fails in CI).
from helpers.viewer_site import (  # noqa: F401 - fixtures, used by name
    HUGE,
    MODEL,
    TOKEN,
    UI,
    XSS_LINK,
    XSS_TEXT,
    Page,
    Site,
    browser,
    expect,
    of_variant,
    page,
    session_state,
    site,
)


def test_login_needs_the_admin_token_and_sets_a_strict_httponly_cookie(browser, site):
    context = browser.new_context()
    page = context.new_page()
    page.goto(site.url + "/episodes/hostile")
    assert "/login" in page.url  # no session: the login form, remembering where to go
    page.fill("#token", "not-the-token")
    page.click("button[type=submit]")
    expect(page.locator(".error")).to_contain_text("Not the admin token")
    created = register(site.proxy, "key-holder")
    page.fill("#token", created["api_key"])
    page.click("button[type=submit]")
    expect(page.locator(".error")).to_contain_text("episode API key")
    assert not context.cookies()
    page.fill("#token", TOKEN)
    page.click("button[type=submit]")
    expect(page.locator("h1")).to_have_text("hostile")  # back where the user was going
    (cookie,) = context.cookies()
    assert cookie["name"] == "tracetap_ui" and TOKEN not in cookie["value"]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert cookie["path"] == UI
    reply = context.request.get(site.url + "/", headers={
        "Authorization": f"Bearer {created['api_key']}"})
    assert reply.status == 403  # an episode key never opens it, even with a session
    page.click("text=Log out")
    expect(page.locator("#token")).to_be_visible()
    assert not context.cookies()
    context.close()


def test_episodes_page_lists_every_episode_with_its_reward_and_finds_the_failed(page, site):
    page.goto(site.url + "/")
    table = page.locator("table.episodes")
    for episode_id in site.plans:
        row = table.locator("tr", has=page.locator(f"a:text-is('{episode_id}')"))
        expect(row).to_have_count(1)
        expect(row.locator(".reward")).to_have_text(
            _reward_text(site, episode_id))
    expect(page.locator("#count")).to_contain_text(f"{len(site.plans) + 4} episodes")
    expect(page.locator(".charts img")).to_have_js_property("complete", True)
    assert page.locator(".charts img").evaluate("img => img.naturalWidth") > 0

    page.select_option("#f-finished", "yes")
    page.fill("#f-outcome", "failed")
    page.click("text=Apply")
    failed = sorted(i for i, o in site.outcomes.items() if o == "failed")
    assert failed, "the demo's episodes include failed ones"
    shown = sorted(page.locator("table.episodes td.id a").all_inner_texts())
    assert shown == failed
    assert "outcome=failed" in page.url  # a stable URL for what is on screen

    page.goto(site.url + "/?status=errors")
    assert page.locator("table.episodes td.id a").all_inner_texts() == ["broken"]
    expect(page.locator("table.episodes")).to_contain_text("1 failed")


def _reward_text(site: Site, episode_id: str) -> str:
    reward = site.rows[episode_id][0]["reward"]
    return f"{reward:.1f}" if reward == int(reward) else f"{reward:g}"


def test_groups_show_their_rewards_side_by_side(page, site):
    group = of_variant(site, "group")
    page.goto(site.url + "/groups")
    chips = page.locator("table.groups .group-rewards a")
    expect(chips).to_have_count(len(group))
    assert sorted(chips.evaluate_all("xs => xs.map(a => a.getAttribute('href'))")) == sorted(
        f"{UI}/episodes/{i}" for i in group)
    page.locator("table.groups td.id a").click()
    expect(page.locator(".group-box .group-rewards a")).to_have_count(len(group))
    assert sorted(page.locator("table.episodes td.id a").all_inner_texts()) == sorted(group)


def test_token_view_shows_exactly_the_exported_trained_tokens(page, site):
    for episode_id in (*of_variant(site, "append-only"), *of_variant(site, "context-rewrite")):
        exported = site.rows[episode_id]
        for index, row in enumerate(exported):
            page.goto(f"{site.url}/episodes/{episode_id}?t={index}&n=8192")
            trained = sum(row["response_mask"])
            assert page.locator("#trained-count").get_attribute("data-trained") == str(trained)
            expect(page.locator("#toks .t.s")).to_have_count(trained)
            total = len(row["prompt_ids"]) + len(row["response_ids"])
            expect(page.locator("#toks .t")).to_have_count(total)
            expect(page.locator("#toks .mk-turn")).to_have_count(row["num_turns"])


def test_the_rewritten_episode_says_why_it_split_and_where(page, site):
    (episode_id,) = of_variant(site, "context-rewrite")
    reasons = [r["split_reason"] for r in site.rows[episode_id]]
    assert reasons == [None, "non_prefix"]
    page.goto(f"{site.url}/episodes/{episode_id}")
    expect(page.locator(".rows")).to_contain_text("row 2: non_prefix")
    page.click("text=row 2: non_prefix")
    box = page.locator(".split-box")
    expect(box).to_contain_text("Why row 2 split: non_prefix")
    expect(box).to_contain_text("rewrote, summarised or replaced its context")
    first, second = site.rows[episode_id]
    a = first["prompt_ids"] + first["response_ids"]
    b = second["prompt_ids"] + second["response_ids"]
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    expect(box).to_contain_text(f"It shares its first {common} tokens with row 1")
    expect(box.locator("table.diverge .t")).to_have_count(16)
    box.locator("text=(show)").click()
    expect(page.locator("#toks .mk-split")).to_have_text("split: non_prefix")


def test_hover_and_keys_show_a_tokens_id_text_logprob_and_alternatives(page, site):
    page.goto(f"{site.url}/episodes/alts")
    first_trained = page.locator("#toks .t.s").first
    first_trained.hover()
    detail = page.locator("#tok-detail")
    expect(detail).to_contain_text("trained (sampled by the model")
    expect(detail).to_contain_text("logprob")
    expect(detail.locator("ol.alts li")).to_have_count(3)
    page.locator("#toks").focus()
    page.keyboard.press("Home")
    expect(detail).to_contain_text("position0")
    expect(detail).to_contain_text("prompt (not trained)")
    page.keyboard.press("ArrowRight")
    expect(detail).to_contain_text("position1")
    page.keyboard.press("End")
    expect(detail).to_contain_text("trained")


def test_episode_and_call_pages_show_calls_timings_and_bodies(page, site):
    (episode_id,) = of_variant(site, "context-rewrite")
    page.goto(f"{site.url}/episodes/{episode_id}")
    calls = page.locator("table.calls tbody tr")
    expect(calls).to_have_count(len(site.proxy.calls(episode_id)))
    expect(page.locator(".timeline svg a")).to_have_count(calls.count())
    expect(page.locator(".turns")).to_contain_text("lookup")  # a tool call, readable
    expect(page.locator(".turn.role-tool").first).to_contain_text("Fact")
    calls.first.locator("a").click()
    expect(page.locator("h1")).to_contain_text("Call 0")
    expect(page.locator("#call-status")).to_have_text("ok")
    expect(page.locator("table")).to_contain_text("engine")  # token_source
    expect(page.locator(".jtree").first).to_contain_text("messages: [2]")
    page.goto(f"{site.url}/episodes/broken")
    expect(page.locator("table.calls .badge.failed")).to_have_text("HTTP 500")


def _one_chat_call(site: Site, episode_id: str) -> None:
    client = openai.OpenAI(base_url=site.proxy.episode_url(episode_id), api_key="x",
                           max_retries=0)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("variant,endpoint", [("responses-api", "responses"),
                                              ("messages-api", "messages:chat")])
def test_responses_and_messages_episodes_read_as_conversations(page, site, variant,
                                                               endpoint):
    (episode_id,) = of_variant(site, variant)
    page.goto(f"{site.url}/episodes/{episode_id}")
    expect(page.locator("table.calls tbody tr").first).to_contain_text(endpoint)
    turns = page.locator(".turns")
    expect(turns.locator(".tool-call").first).to_contain_text("lookup")
    expect(turns.locator(".turn.role-tool").first).to_contain_text("Fact")
    expect(turns.locator(".turn.reply")).to_have_count(1)
    trained = sum(site.rows[episode_id][0]["response_mask"])
    assert trained > 0
    assert page.locator("#trained-count").get_attribute("data-trained") == str(trained)


def test_live_page_shows_new_calls_within_a_second_and_pauses(page, site):
    _one_chat_call(site, "live-0")  # stored just before the page opens: listed once, not twice
    site.proxy.flush()
    page.goto(site.url + "/live")
    expect(page.locator("#live-state")).to_have_text("live")
    expect(page.locator("#live-calls")).to_contain_text("live-0")
    _one_chat_call(site, "live-1")
    expect(page.locator("#live-calls")).to_contain_text("live-1")
    expect(page.locator("#live-episodes")).to_contain_text("live-1")
    links = page.locator("#live-calls a[href*='/calls/']").evaluate_all(
        "xs => xs.map(a => a.getAttribute('href'))")
    assert len(links) == len(set(links))
    page.click("#live-pause")
    expect(page.locator("#live-pause")).to_have_attribute("aria-pressed", "true")
    _one_chat_call(site, "live-2")
    expect(page.locator("#live-held")).to_contain_text("new, held")
    expect(page.locator("#live-calls")).not_to_contain_text("live-2")
    page.click("#live-pause")
    expect(page.locator("#live-calls")).to_contain_text("live-2")


def test_hostile_agent_content_is_shown_as_text_and_never_runs(page, site):
    for path in ("/", "/episodes/hostile", "/live", "/groups"):
        reply = page.goto(site.url + path)
        csp = reply.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp
        assert page.evaluate("window.__xss") is None
    page.goto(site.url + "/episodes/hostile")
    expect(page.locator(".turns")).to_contain_text(XSS_TEXT)
    expect(page.locator(".turns")).to_contain_text("javascript:window.__xss = 3")
    expect(page.locator(".facts")).to_contain_text("<script>window.__xss = 5</script>")
    expect(page.locator("#outcome")).to_have_text("</dd><script>window.__xss = 6</script>")
    assert page.locator("a[href^='javascript:'], img[src='x']").count() == 0
    assert page.locator("main script").count() == 1  # the token data block, JSON only
    # The oversized word wraps: nothing is wider than the window.
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    expect(page.locator(".turns")).to_contain_text("more characters")
    page.locator("table.calls tbody a").first.click()
    expect(page.locator(".jtree").first).to_contain_text("window.__xss = 1")
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    assert page.evaluate("window.__xss") is None
    assert page.dialogs == []
