"""The viewer hides credentials everywhere, says what it leaves out and searches within
bounds, in a real Chromium (Playwright driving Debian's ``chromium``).

One module-scoped proxy in front of the mock engine; every call goes through it with the
real ``openai`` SDK. Fails in CI (env CI) when chromium or Playwright is missing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import openai
import pytest
from helpers.chromium import Page, expect, launched
from helpers.http import finish, register
from helpers.servers import Proxy
from helpers.viewer_site import serving

TOKEN = "safe-test-admin-token"
UI = "/tracetap/ui"
MODEL = "mock-model"
SECRETS = {"body": "sk-body-4f1c", "argument": "hunter2-arg", "nested": "sk-nested-77",
           "tool output": "tok-tool-9d", "metadata": "pw-meta-5e"}
VARIANTS = "/variants?baseline=harness%3Dvb&candidate=harness%3Dvc&success=solved"


@dataclass
class Site:
    proxy: Proxy
    url: str
    usage: dict[str, list[tuple[int, int]]] = field(default_factory=dict)


def _client(created: dict) -> openai.OpenAI:
    return openai.OpenAI(base_url=created["base_url"], api_key=created["api_key"],
                         max_retries=0)


def _secret_call(site: Site) -> None:
    client = _client(register(site.proxy, "secretive", task_id="deploy",
                              metadata={"db_password": SECRETS["metadata"], "batch": "s"}))
    arguments = json.dumps({"password": SECRETS["argument"], "target": "prod",
                            "config": json.dumps({"api_key": SECRETS["nested"]})})
    client.chat.completions.create(model=MODEL, extra_body={"api_key": SECRETS["body"]},
                                   messages=[
        {"role": "user", "content": "deploy it"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t1", "type": "function",
             "function": {"name": "deploy", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "t1",
         "content": f"deploy ok quokkafound API_TOKEN={SECRETS['tool output']} done"}])


def _episode(site: Site, eid: str, harness: str, task: str, outcome: str,
             infra: bool = False) -> None:
    """Two append-only calls (or one failed upstream: integrity infra), then finished."""
    client = _client(register(site.proxy, eid, task_id=task,
                              harness={"name": harness, "config": {"ctx": harness}}))
    messages = [{"role": "user", "content": f"solve {task}"}]
    usage = site.usage.setdefault(eid, [])
    for _ in range(2):
        reply = client.chat.completions.create(model=MODEL, messages=messages)
        usage.append((reply.usage.prompt_tokens, reply.usage.completion_tokens))
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "go on"}]
    if infra:
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model=MODEL, messages=messages,
                                           extra_body={"mock_status": 500})
    finish(site.proxy, eid, 1.0 if outcome == "solved" else 0.0, outcome=outcome)


# t1: clean, the baseline solves 1 of 2 and the candidate 2 of 2 (fixed); counted with the
# infra ones it would be 3 of 4 against 2 of 3. t2 unchanged; t3 the candidate's alone.
EPISODES = [("b-t1-0", "vb", "t1", "solved", False), ("b-t1-1", "vb", "t1", "failed", False),
            ("b-t1-2", "vb", "t1", "solved", True), ("b-t1-3", "vb", "t1", "solved", True),
            ("c-t1-0", "vc", "t1", "solved", False), ("c-t1-1", "vc", "t1", "solved", False),
            ("c-t1-2", "vc", "t1", "failed", True), ("b-t2-0", "vb", "t2", "solved", False),
            ("c-t2-0", "vc", "t2", "solved", False), ("c-t3-0", "vc", "t3", "failed", False)]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Iterator[Site]:
    with serving(tmp_path_factory.mktemp("safe"), TOKEN) as (proxy, _):
        s = Site(proxy, proxy.url + UI)
        _secret_call(s)
        for spec in EPISODES:
            _episode(s, *spec)
        register(proxy, "b-t1-running", task_id="t1",
                 harness={"name": "vb", "config": {"ctx": "vb"}})  # unfinished
        proxy.flush()
        yield s


@pytest.fixture(scope="module")
def browser(site):
    with launched() as chromium:
        yield chromium


@pytest.fixture
def page(browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 900},
                                  extra_http_headers={"Authorization": f"Bearer {TOKEN}"})
    yield context.new_page()
    context.close()


def _no_secret(text: str, where: str) -> None:
    for what, secret in SECRETS.items():
        assert secret not in text, f"the {what} credential is in {where}"


def test_credentials_are_hidden_on_the_call_page_downloads_and_snippets(page, site):
    page.goto(site.url + "/episodes/secretive")
    _no_secret(page.content(), "the episode page")
    expect(page.locator("main")).to_contain_text("db_password")
    page.locator("table.calls tbody td:first-child a").first.click()
    expect(page.locator(".turns")).to_contain_text("deploy ok quokkafound")
    expect(page.locator(".turns")).to_contain_text("(hidden: a credential is never shown)")
    _no_secret(page.content(), "the call page")
    call_url = page.url
    for which in ("request", "response"):
        download = page.request.get(f"{call_url}/{which}.json")
        assert download.status == 200
        _no_secret(download.text(), f"the {which}.json download")
    body = json.loads(page.request.get(f"{call_url}/request.json").text())
    assert body["api_key"].startswith("(hidden")
    arguments = json.loads(body["messages"][1]["tool_calls"][0]["function"]["arguments"])
    assert arguments["target"] == "prod" and arguments["password"].startswith("(hidden")
    assert json.loads(arguments["config"])["api_key"].startswith("(hidden")  # JSON in JSON
    # The index holds the words; the snippet never shows the credential, even searched for.
    for q in ("quokkafound", SECRETS["argument"], SECRETS["tool output"]):
        page.goto(f"{site.url}/search?q={q}")
        expect(page.locator("table.results td.id a")).to_have_text(["secretive"])
        _no_secret(page.locator("table.results").inner_html(), f"the snippet for {q}")


def test_a_word_repeated_counts_once_and_too_many_words_are_refused_clearly(page, site):
    ids = page.locator("table.results td.id a")
    page.goto(site.url + "/search?q=ok")
    once = ids.all_inner_texts()
    assert "secretive" in once
    page.goto(site.url + "/search?q=" + "+".join(["ok"] * 64))  # 191 characters
    expect(ids).to_have_text(once)
    page.goto(site.url + "/search?q=" + "+".join(f"w{k}" for k in range(63)))
    expect(page.locator("h1")).to_have_text("Bad request")
    expect(page.locator(".error")).to_contain_text("63 different words; at most 16")


def test_variants_count_and_show_the_episodes_they_leave_out(page, site):
    page.goto(site.url + VARIANTS)
    expect(page.locator("#variants-error")).to_contain_text("tick “drop unpaired tasks”")
    assert "--allow-unpaired" not in page.locator("main").inner_text()
    page.check("#v-unpaired")
    page.click("#variants-form button[type=submit]")
    expect(page.locator("#left-out")).to_contain_text("2 episodes of harness=vb")
    expect(page.locator("#left-out")).to_contain_text("1 episodes of harness=vc")
    expect(page.locator("#left-out")).to_contain_text("not finished yet: 1 episodes of harness=vb")
    rows = page.locator("#variants tbody tr")
    expect(rows.nth(0).locator("td").nth(1)).to_have_text("3 (+2 infra left out)")
    expect(rows.nth(1).locator("td").nth(1)).to_have_text("4 (+1 infra left out)")
    fixed = page.locator("#fixed-1 tbody tr")
    expect(fixed.locator("td").first).to_have_text("t1")
    # The chips are the episodes the verdict counted, and they add up to it.
    expect(fixed.locator(".baseline-chips .tally")).to_have_text("1 of 2 succeeded")
    expect(fixed.locator(".candidate-chips .tally")).to_have_text("2 of 2 succeeded")
    expect(fixed.locator(".baseline-chips a")).to_have_count(2)
    expect(fixed.locator(".left-out-chips a")).to_have_count(3)
    # Δ_B is the difference of the paired tasks' means the page states.
    delta = float(page.locator("#variants td.delta").get_attribute("data-delta"))
    said = page.locator("#paired-means li").inner_text()
    base, cand = map(float, re.search(r"success ([\d.]+) → ([\d.]+)", said).groups())
    assert cand - base == pytest.approx(delta, abs=1e-3) and delta == pytest.approx(0.25)
    assert "the 1 unpaired tasks' included" in said


def test_token_figures_are_trajectory_tokens_and_usage_is_labelled(page, site):
    page.goto(site.url + VARIANTS + "&unpaired=yes")
    header = page.locator("#variants thead")
    expect(header).to_contain_text("Trajectory tokens / ep")
    expect(header).to_contain_text("Usage sum / ep")
    assert "summed over the calls" in header.locator("abbr").nth(1).get_attribute("title")
    counted = [e for e, h, _, _, infra in EPISODES if h == "vb" and not infra]
    trajectory = sum(max(p + c for p, c in site.usage[e]) for e in counted) / len(counted)
    usage = sum(sum(p + c for p, c in site.usage[e]) for e in counted) / len(counted)
    cells = page.locator("#variants tbody tr").first.locator("td")
    expect(cells.nth(9)).to_have_text(f"{round(trajectory):,}")
    expect(cells.nth(10)).to_have_text(f"{round(usage):,}")
    assert trajectory < usage
    page.goto(site.url + "/harnesses")
    expect(page.locator("#coverage-summary")).to_contain_text(
        "10 finished episodes (2 not finished yet left out)")
    svg = page.request.get(site.url + "/charts.svg").text()
    assert "trajectory tokens per episode" in svg
    assert "reward (2 without a reward left out)" in svg  # the two never finished
