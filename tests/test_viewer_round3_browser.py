"""The viewer's token view and tree, round 3, in a real Chromium (Playwright driving
Debian's ``chromium``): a credential the agent put in its prompt is hidden token by token
(nothing of it in the page, positions kept); a harness config value under a credential's
name is hidden on the harnesses page; a compacted conversation is drawn as the export
links it (``compaction`` rows, the row continued, the summary call as a summariser under
the conversation it summarised); annotated token spans are highlighted in the token view,
and the selected token starts a span annotation from the keyboard.

One module-scoped proxy in front of the mock engine; every call goes through it with the
real ``openai`` SDK. Fails in CI (env CI) when chromium or Playwright is missing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest
from helpers.chromium import Page, expect, launched
from helpers.http import finish, register, request_json
from helpers.servers import Proxy
from helpers.viewer_site import serving

from tracetap.demo.tokenizer import encode

TOKEN = "round3-test-admin-token"
UI = "/tracetap/ui"
MODEL = "mock-model"
PASSWORD = "Hunter2-SECRETVALUE-77"
API_KEY = "sk-SECRETKEY-0099"
CONFIG_SECRET = "sk-CONFIGSECRET-31"
PROMPT = (f'Deploy it. The db password: "{PASSWORD}" and the tool config '
          f'{{"api_key": "{API_KEY}", "region": "eu"}}. Report when done.')


@dataclass
class Site:
    proxy: Proxy
    url: str
    calls: dict[str, str]


def _chat(client: openai.OpenAI, system: str, user: str) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": system},
                               {"role": "user", "content": user}])


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Iterator[Site]:
    with serving(tmp_path_factory.mktemp("round3"), TOKEN) as (proxy, _):
        calls = {}
        created = register(proxy, "secret", task_id="deploy", harness={
            "name": "deployer", "config": {"api_key": CONFIG_SECRET, "context": "full"}})
        client = openai.OpenAI(base_url=created["base_url"], api_key=created["api_key"],
                               max_retries=0)
        calls["secret"] = _chat(client, "You deploy services.", PROMPT).id
        finish(proxy, "secret", 1.0, outcome="solved")
        created = register(proxy, "compacted", task_id="long-task")
        client = openai.OpenAI(base_url=created["base_url"], api_key=created["api_key"],
                               max_retries=0)
        # As Claude Code compacts: the conversation asked for a summary, then started
        # over from it.
        history = [{"role": "system", "content": "You fix bugs."},
                   {"role": "user", "content": "fix the parser bug"}]
        first = client.chat.completions.create(model=MODEL, messages=history)
        history.append({"role": "assistant", "content": first.choices[0].message.content})
        summary = client.chat.completions.create(model=MODEL, messages=[
            *history, {"role": "user", "content": "Summarise the conversation so far."}])
        text = summary.choices[0].message.content
        start = client.chat.completions.create(model=MODEL, messages=[history[0], {
            "role": "user", "content": f"Summary of the work so far:\n{text}\nGo on."}])
        calls.update(first=first.id, summary=summary.id, start=start.id)
        finish(proxy, "compacted", 1.0, outcome="solved")
        proxy.flush()
        yield Site(proxy, proxy.url + UI, calls)


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


def _data(page: Page) -> dict:
    return json.loads(page.locator("#tok-data").text_content())


def _holds(ids: list, secret: str) -> bool:
    wanted = encode(secret)
    return any(ids[i:i + len(wanted)] == wanted for i in range(len(ids)))


def test_a_credential_in_the_prompt_is_hidden_token_by_token(page, site):
    page.goto(site.url + "/episodes/secret")
    box = page.locator("#toks")
    shown = box.text_content()
    assert "db password" in shown and "api_key" in shown and "region" in shown  # the rest
    html = page.content()
    for secret in (PASSWORD, API_KEY):
        assert secret not in shown
        for piece in (secret[:8], secret[-8:]):
            assert piece not in shown and piece not in html
    data = _data(page)
    assert not _holds(data["ids"], PASSWORD) and not _holds(data["ids"], API_KEY)
    tokens = box.locator(".t")
    # Every token still has its place: as many spans as ids, one hidden span per token.
    assert tokens.count() == len(data["ids"]) == data["ids"].count(None) + sum(
        1 for i in data["ids"] if i is not None)
    hidden = box.locator(".t.h")
    assert hidden.count() == len(encode(PASSWORD)) + len(encode(API_KEY))
    assert data["ids"].count(None) == hidden.count()
    # Selecting a hidden token says so, and shows neither id nor text.
    hidden.first.click()
    expect(page.locator("#tok-detail")).to_contain_text("(hidden: part of a credential)")
    # A window that starts inside the value: the key is before it, the value still hidden.
    first = next(i for i, v in enumerate(data["ids"]) if v is None)
    page.goto(site.url + f"/episodes/secret?at={data['start'] + first + 4}&n=64")
    assert PASSWORD[6:] not in page.locator("#toks").text_content()
    assert page.locator("#toks .t").first.get_attribute("class").endswith(" h")


def test_a_credential_in_the_harness_config_is_hidden_on_the_pages(page, site):
    page.goto(site.url + "/harnesses")
    expect(page.locator("main")).to_contain_text("api_key")
    expect(page.locator("main")).to_contain_text("context")
    assert CONFIG_SECRET not in page.content()
    page.goto(site.url + "/episodes/secret")
    assert CONFIG_SECRET not in page.content()


def test_a_compaction_is_linked_as_the_export_links_it(page, site):
    page.goto(site.url + "/episodes/compacted")
    rows = page.locator("ul.rows > li")
    texts = rows.all_inner_texts()
    assert len(texts) == 3, texts
    compaction = rows.filter(has_text="compaction")
    expect(compaction).to_have_count(1)
    continued = compaction.locator("a.continues")
    expect(continued).to_have_text("row 1")  # the conversation before the summary
    summary_href = compaction.locator("a.summary-call").get_attribute("href")
    compaction.locator("a.summary-call").click()
    expect(page.locator("main")).to_contain_text("Summarise the conversation so far.")
    expect(page.locator("#call-lineage")).to_contain_text("summariser")
    expect(page.locator("#call-lineage")).to_contain_text("started by the main")
    page.go_back()
    compaction.locator("a").first.click()
    expect(page.locator("#split-h")).to_contain_text("compaction")
    continued = page.locator("ul.rows > li", has_text="compaction").locator("a.continues")
    continued.click()
    expect(page.locator("ul.rows a[aria-current=true]")).to_contain_text("row 1")
    # The tree: the summary call is a summariser under the conversation it summarised,
    # and the segment after it is that conversation's own (one lineage, not two).
    tree = page.locator("#lineages ul.lineage-tree").first
    roots = tree.locator(":scope > li.lineage")
    expect(roots).to_have_count(1)
    expect(roots.locator(":scope > details > summary .lineage-kind")).to_have_text("main")
    nested = roots.locator(":scope > details > ul.lineage-tree > li.lineage")
    expect(nested).to_have_count(1)
    expect(nested.locator(".lineage-kind")).to_have_text("summariser")
    expect(nested.locator("ol.lineage-calls a")).to_have_attribute("href", summary_href)
    expect(roots.locator(":scope > details > ol.lineage-calls a")).to_have_count(2)


def test_annotated_spans_are_highlighted_and_the_keyboard_starts_one(page, site):
    page.goto(site.url + "/episodes/secret")
    call = page.locator("#toks a.mk-turn").first.get_attribute("href").rsplit("/", 1)[1]
    status, _ = request_json("POST", site.proxy.url + "/tracetap/annotations", {
        "call": call, "choice": 0, "start": 2, "end": 5, "label": "hedging"}, token=TOKEN)
    assert status == 201
    page.reload()
    data = _data(page)
    span = next(s for s in data["spans"] if s[4] == call)
    marked = page.locator("#toks .t.ann")
    expect(marked).to_have_count(3)
    first = span[0] - data["start"] + 2
    assert page.locator("#toks .t").nth(first).get_attribute("class").endswith("ann")
    expect(marked.first).to_have_attribute("title", "hedging")
    # The keyboard: the last token (the completion's end) selected, `a`, the form
    # prefilled with it; a label typed, Enter: stored as that call's span.
    page.locator("#toks").focus()
    page.keyboard.press("End")
    page.keyboard.press("a")
    expect(page.locator("#span-form")).to_be_visible()
    expect(page.locator("#span-label")).to_be_focused()
    last = span[1] - span[0] - 1
    expect(page.locator("#span-start")).to_have_value(str(last))
    expect(page.locator("#span-end")).to_have_value(str(last + 1))
    expect(page.locator("#span-choice")).to_have_value("0")
    page.keyboard.type("ends-well")
    page.keyboard.press("Enter")
    expect(page.locator("#annotations")).to_contain_text("ends-well")
    expect(page.locator("#toks .t.ann")).to_have_count(4)
    expect(page.locator("#toks .t.ann").last).to_have_attribute("title", "ends-well")
    # A prompt token cannot start one: the panel says so.
    page.locator("#toks").focus()
    page.keyboard.press("Home")
    page.keyboard.press("a")
    expect(page.locator("#span-refused")).to_be_visible()
    expect(page.locator("#span-form")).to_be_hidden()


def test_the_compare_page_hides_the_credential_too(page, site):
    page.goto(site.url + "/compare?a=compacted&b=secret")
    views = page.locator(".toks")
    text = " ".join(views.all_text_contents())
    assert "db password" in text  # B's prompt is drawn from before the divergence on
    expect(page.locator(".toks .t.h")).to_have_count(len(encode(PASSWORD)) + len(encode(API_KEY)))
    for secret in (PASSWORD, API_KEY):
        assert secret[:8] not in text and secret[-8:] not in page.content()
