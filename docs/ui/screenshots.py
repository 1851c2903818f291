"""Regenerate the screenshots in docs/ui/ from a real ``tracetap demo --ui``.

    python docs/ui/screenshots.py        # needs Playwright and Debian's chromium

Runs the demo (mock engine, proxy, scripted agent), logs in to its viewer with the token
the demo prints, and photographs each page in Chromium at 1280 px wide (then shrinks the
files with pngquant, where it is installed).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import openai
from playwright.sync_api import expect, sync_playwright

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def main() -> int:
    demo = subprocess.Popen([sys.executable, "-m", "tracetap", "demo", "--ui", "--quiet",
                             "--variants"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    found: dict[str, str] = {}
    for line in demo.stdout:
        for key, pattern in (("ui", r"^trace viewer: (\S+)"), ("token", r"admin token: (\S+)"),
                             ("split", r"why the rewrite split:\s+(\S+)")):
            match = re.search(pattern, line)
            if match:
                found[key] = match.group(1)
        if "Ctrl-C" in line:
            break
    try:
        shoot(found["ui"], found["token"], found["split"])
    finally:
        demo.terminate()
        demo.wait(30)
    if shutil.which("pngquant"):  # Debian's pngquant: a third of the bytes, same look
        subprocess.run(["pngquant", "--force", "--ext", ".png", "--quality", "70-95",
                        *map(str, HERE.glob("*.png"))], check=True)
    return 0


def shoot(ui: str, token: str, split: str) -> None:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"),
                                    args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 820})
        page.goto(ui)
        page.screenshot(path=HERE / "login.png")
        page.fill("#token", token)
        page.click("button[type=submit]")
        # (page.wait_for_function would evaluate a string: the viewer's CSP forbids that)
        expect(page.locator(".charts img")).to_have_js_property("complete", True)
        page.screenshot(path=HERE / "episodes.png")
        page.goto(ui + "groups")
        page.screenshot(path=HERE / "groups.png")
        page.goto(split.replace("#tokens", ""))
        page.screenshot(path=HERE / "episode.png")
        page.goto(split)
        page.locator("#toks .t.s").nth(40).hover()
        page.screenshot(path=HERE / "tokens.png")
        page.locator("table.calls tbody a").nth(2).click()
        page.screenshot(path=HERE / "call.png")
        page.goto(ui + "live")
        page.wait_for_selector("#live-state:text('live')")
        agent_url = ui.split("/tracetap/ui")[0] + "/episodes/live-demo/v1"
        client = openai.OpenAI(base_url=agent_url, api_key="unused", max_retries=0)
        client.chat.completions.create(model="mock-model",
                                       messages=[{"role": "user", "content": "hello"}])
        page.wait_for_selector("#live-calls tr.new:has-text('live-demo')")
        page.screenshot(path=HERE / "live.png")
        shoot_compare(page, ui, split)
        browser.close()


def shoot_compare(page, ui: str, split: str) -> None:
    """The compare pages, the coverage heatmap and the low-probability panel."""
    episode = split.split("/episodes/")[1].split("?")[0]
    page.goto(split.replace("#tokens", "#lowp"))
    page.locator("#lowest tbody a").first.click()
    page.locator("#lowp").screenshot(path=HERE / "lowp.png")
    page.goto(f"{ui}compare?a={episode}&b={episode}&ta=0&tb=1")
    page.screenshot(path=HERE / "compare.png")
    page.goto(f"{ui}variants?baseline=config.context%3Dfull"
              "&candidate=config.context%3Dsummarised&success=solved")
    page.screenshot(path=HERE / "variants.png", full_page=True)
    page.goto(f"{ui}harnesses?where=meta.batch%3Dvariants&factor=context,seed&success=solved")
    page.screenshot(path=HERE / "harnesses.png", full_page=True)
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{ui}compare?a={episode}&b={episode}&ta=0&tb=1")
    page.screenshot(path=HERE / "compare-390.png")


if __name__ == "__main__":
    sys.exit(main())
