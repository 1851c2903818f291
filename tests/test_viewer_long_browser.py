"""A long episode in the viewer, in Chromium: 30 turns whose trajectory ends at ~65,000
tokens (demo.long_episode, stored through storage as the proxy stores calls). Its page
collapses the conversation's earlier turns, is sent compressed, has a skip link to the
token box, centres a token jumped to with `n`, follows a dark system setting; a fresh
`tracetap ui` process answers its first page without importing anything on the way.
``TRACETAP_UI_SHOTS=docs/ui`` also writes the screenshots docs/ui.md shows of it.
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
import time
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.chromium import Page, expect, launched
from helpers.loop import free_port
from helpers.viewer_site import TOKEN, UI, serving

from tracetap.demo.long_episode import long_episode
from tracetap.storage.engine import create_engine
from tracetap.storage.rows import insert_calls

SHOTS = os.environ.get("TRACETAP_UI_SHOTS")
EPISODE = "long-30"
MESSAGES = 60  # the last call's request; then its reply


@pytest.fixture(scope="module")
def long_site(tmp_path_factory) -> Iterator[tuple[str, str]]:
    """(viewer URL, database URL) of a proxy whose database holds the long episode."""
    data = tmp_path_factory.mktemp("long")
    with serving(data, TOKEN) as (proxy, loop):
        async def store():
            engine = create_engine(proxy.settings.database_url)
            try:
                await insert_calls(engine, long_episode(EPISODE))
            finally:
                await engine.dispose()

        loop.run(store())
        yield proxy.url + UI, proxy.settings.database_url


@pytest.fixture(scope="module")
def browser(long_site):
    with launched() as chromium:
        yield chromium


def _page(browser, **options) -> Page:
    context = browser.new_context(viewport={"width": 1280, "height": 900},
                                  extra_http_headers={"Authorization": f"Bearer {TOKEN}"},
                                  **options)
    return context.new_page()


@pytest.fixture
def page(browser) -> Iterator[Page]:
    page = _page(browser)
    yield page
    page.context.close()


def _shoot(page: Page, name: str, at: str) -> None:
    if SHOTS:
        page.locator(at).evaluate("e => e.scrollIntoView()")
        path = Path(SHOTS) / name
        page.screenshot(path=path)
        if shutil.which("pngquant"):  # a third of the bytes, same look
            subprocess.run(["pngquant", "--force", "--ext", ".png", "--quality", "70-95",
                            str(path)], check=True)


def test_earlier_turns_are_collapsed_and_open_by_mouse_and_keyboard(page, long_site):
    url, _ = long_site
    page.goto(f"{url}/episodes/{EPISODE}")
    turns = page.locator("ol.turns > li")
    expect(turns).to_have_count(MESSAGES + 1)
    folded = page.locator("ol.turns > li.folded")
    # everything before the request's last assistant message: the last turn (its tool
    # result and the reply) stays open
    expect(folded).to_have_count(MESSAGES - 1)
    assert page.locator("details.fold[open]").count() == 0
    expect(turns.last).to_contain_text("every test passes")
    expect(turns.nth(MESSAGES - 1).locator("pre.text")).to_be_visible()
    system = folded.first
    expect(system.locator("summary .preview")).to_contain_text("You are a coding agent.")
    expect(system.locator("pre.text")).to_be_hidden()
    height = page.locator("ol.turns").evaluate("e => e.getBoundingClientRect().height")
    assert height < 3000, height  # 19,593 px when every message was open
    _shoot(page, "conversation.png", "#conv-h")
    system.locator("summary").click()  # mouse
    expect(system.locator("pre.text")).to_be_visible()
    third = folded.nth(2)  # the first assistant turn, with its tool call
    third.locator("summary").focus()
    page.keyboard.press("Enter")
    expect(third.locator(".tool-call pre.args")).to_be_visible()
    expect(third.locator(".tool-call")).to_contain_text("shell")
    fourth = folded.nth(3)
    fourth.locator("summary").focus()
    page.keyboard.press(" ")
    expect(fourth.locator("pre.text")).to_be_visible()
    page.keyboard.press("Enter")  # and closed again
    expect(fourth.locator("pre.text")).to_be_hidden()
    everything = page.locator("button.fold-all")
    everything.click()
    expect(page.locator("details.fold[open]")).to_have_count(MESSAGES - 1)
    expect(folded.nth(MESSAGES - 2).locator("pre.text")).to_be_visible()
    expect(everything).to_have_text(f"Collapse the {MESSAGES - 1} earlier messages")
    everything.click()
    expect(page.locator("details.fold[open]")).to_have_count(0)


def _get(url: str, encoding: str | None) -> tuple[dict, bytes]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    if encoding:
        headers["Accept-Encoding"] = encoding
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers)) as reply:
        return {k.lower(): v for k, v in reply.headers.items()}, reply.read()


def test_pages_are_compressed_and_the_long_episode_is_under_60_kb(page, long_site):
    url, _ = long_site
    reply = page.goto(f"{url}/episodes/{EPISODE}")
    assert reply.headers.get("content-encoding") in ("gzip", "deflate")
    expect(page.locator("#toks .t").first).to_be_attached()
    headers, body = _get(f"{url}/episodes/{EPISODE}", "gzip")
    assert headers["content-encoding"] == "gzip" and headers["vary"] == "Accept-Encoding"
    html = gzip.decompress(body)
    assert len(body) <= 60_000, len(body)
    assert len(html) > 3 * len(body)  # the whole page came, compressed
    headers, body = _get(f"{url}/episodes/{EPISODE}", "deflate")
    assert headers["content-encoding"] == "deflate"
    assert zlib.decompress(body).count(b"<li class=\"turn") == MESSAGES + 1
    headers, plain = _get(f"{url}/episodes/{EPISODE}", None)  # a client that cannot inflate
    assert "content-encoding" not in headers and plain.count(b"<li class=\"turn") == MESSAGES + 1
    # downloads are the stored bodies as they are
    headers, raw = _get(f"{url}/calls/{EPISODE}-29/request.json", "gzip")
    assert "content-encoding" not in headers and raw.startswith(b'{"model"')


def test_a_skip_link_reaches_the_token_box_within_five_tabs(page, long_site):
    url, _ = long_site
    page.goto(f"{url}/episodes/{EPISODE}")
    for _ in range(5):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.id") == "skip-tokens":
            break
    expect(page.locator("#skip-tokens")).to_be_focused()
    expect(page.locator("#skip-tokens")).to_be_visible()  # shown while focused
    page.keyboard.press("Enter")
    expect(page.locator("#toks")).to_be_focused()
    page.keyboard.press("ArrowRight")
    expect(page.locator("#tok-detail")).to_contain_text("position1")


CENTRE_OF = """(box, k) => {
  const node = box.querySelector('.t[data-k="' + k + '"]');
  const a = box.getBoundingClientRect(), b = node.getBoundingClientRect();
  return [b.top + b.height / 2 - (a.top + box.clientTop + box.clientHeight / 2), b.height];
}"""


def test_n_scrolls_the_selected_token_into_the_middle_of_the_box(page, long_site):
    url, _ = long_site
    page.goto(f"{url}/episodes/{EPISODE}?at=8192&n=4096")
    box = page.locator("#toks")
    expect(box.locator(".t.lowp-mark").first).to_be_attached()
    # the first low token the box must scroll to (below its first screen, and far
    # enough from the end that the middle is reachable)
    target = box.evaluate("""box => {
      const marks = Array.from(box.querySelectorAll('.t.lowp-mark'));
      const top = box.getBoundingClientRect().top;
      const i = marks.findIndex(m => m.getBoundingClientRect().top - top > box.clientHeight
        && m.getBoundingClientRect().top - top < box.scrollHeight - box.clientHeight);
      return [i, i < 0 ? -1 : Number(marks[i].dataset.k)];
    }""")
    presses, k = target
    assert presses >= 0, "no low token below the box's first screen"
    page.locator("h1").click()  # the keys go to the page, not a field
    for _ in range(presses + 1):
        page.keyboard.press("n")
    expect(box.locator(".t.sel")).to_have_attribute("data-k", str(k))
    offset, line = box.evaluate(CENTRE_OF, k)
    assert abs(offset) <= line, f"{offset:.0f} px from the middle of the box"
    assert box.evaluate("b => b.scrollTop") > 0
    page.keyboard.press("n")  # the next one is centred too (when the box can scroll to it)
    k2 = int(box.locator(".t.sel").get_attribute("data-k"))
    if box.evaluate("b => b.scrollTop + b.clientHeight < b.scrollHeight - 1"):
        offset, line = box.evaluate(CENTRE_OF, k2)
        assert abs(offset) <= line
    box.evaluate("b => { b.scrollTop = 0; }")  # the reader scrolled away; p comes back
    page.keyboard.press("p")
    expect(box.locator(".t.sel")).to_have_attribute("data-k", str(k))
    offset, line = box.evaluate(CENTRE_OF, k)
    assert abs(offset) <= line, f"p: {offset:.0f} px from the middle of the box"


def _luminance(css: str) -> float:
    r, g, b = (int(v) / 255 for v in css[css.index("(") + 1:css.index(")")].split(",")[:3])
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (r, g, b)]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def _contrast(a: str, b: str) -> float:
    hi, lo = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


STYLES = """sel => { const s = getComputedStyle(document.querySelector(sel));
  return [s.backgroundColor, s.color]; }"""


@pytest.mark.parametrize("scheme", ["dark", "light"])
def test_the_theme_follows_the_system_setting(browser, long_site, scheme):
    url, _ = long_site
    page = _page(browser, color_scheme=scheme)
    try:
        page.goto(f"{url}/episodes/{EPISODE}")
        body_bg, body_fg = page.evaluate(STYLES, "body")
        card_bg, _ = page.evaluate(STYLES, ".facts")
        toks_bg, _ = page.evaluate(STYLES, "#toks")
        _, who_fg = page.evaluate(STYLES, ".turn .who")
        _, muted_fg = page.evaluate(STYLES, ".fold .preview")
        dark = scheme == "dark"
        for background in (body_bg, card_bg, toks_bg):
            assert (_luminance(background) < 0.05) == dark, background
        assert _contrast(body_fg, body_bg) >= 7
        assert _contrast(who_fg, card_bg) >= 4.5
        assert _contrast(muted_fg, card_bg) >= 4.5
        # the logprob scale keeps its colours and stays readable on them
        token_bg, token_fg = page.evaluate(STYLES, ".legend .t.s.l1")
        assert token_bg == "rgb(181, 212, 234)" and _contrast(token_fg, token_bg) >= 4.5
        if dark and SHOTS:  # a window with the model's turns, a token selected
            page.goto(f"{url}/episodes/{EPISODE}?at=3072&sel=3700")
            _shoot(page, "episode-dark.png", "#tokens-h")
    finally:
        page.context.close()


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_fresh_viewer_process_answers_its_first_page_without_warming_up(long_site,
                                                                           tmp_path):
    """A new `tracetap ui` loads what reading a stored body needs as it starts: importing
    the block codec (pyarrow) inside the first request made it 0.4-1.4 s. The first
    request's CPU is measured (the machine's load inflates wall time, not CPU)."""
    _, database = long_site
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tracetap", "ui", "--db", database, "--port", str(port),
         "--admin-token", TOKEN, "--data-dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}{UI}"
        deadline = time.monotonic() + 60
        while True:
            try:
                _get(base + "/login", None)
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None
                time.sleep(0.1)
        # the block codec (pyarrow's zstd) is loaded before any page is asked for
        with open(f"/proc/{server.pid}/maps") as maps:
            assert "libarrow" in maps.read()
        spent = []
        for path in (f"/calls/{EPISODE}-29", f"/episodes/{EPISODE}"):
            before = _cpu_seconds(server.pid)
            _get(base + path, "gzip")
            spent.append(_cpu_seconds(server.pid) - before)
        assert spent[0] < 0.25 and spent[1] < 0.3, spent  # 0.07-0.09 and 0.04 s idle
    finally:
        server.terminate()
        server.wait(10)
