"""The viewer's browser tests' bench (test_viewer_*browser.py): one proxy in front of the
mock engine captures a small demo-like set of episodes (append-only, context rewrite, a
GRPO group, a failed call, top logprobs, a hostile agent), exported; a real Chromium
(Playwright driving Debian's ``chromium``) logged in to its viewer. Importing this module
skips the importing test module when chromium or Playwright is missing, and fails in CI.

The fixtures are module-scoped: each test module that imports them gets its own site.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import anthropic
import openai
import pyarrow.parquet as pq
import pytest

from helpers.chromium import Page, expect, launched
from helpers.http import finish, register
from helpers.loop import LoopThread, free_port
from helpers.servers import Proxy
from tracetap.demo.agent import run_agent
from tracetap.demo.api_agents import run_messages_agent, run_responses_agent
from tracetap.demo.engine import EngineConfig, EngineServer
from tracetap.demo.runner import MODEL, plan_episodes
from tracetap.exporters import export
from tracetap.migrations import upgrade
from tracetap.proxy.runtime.settings import Settings

TOKEN = "viewer-test-admin-token"
RUN = "v1"
UI = "/tracetap/ui"
XSS_TEXT = '<script>window.__xss = 1</script><img src=x onerror="window.__xss = 2">'
XSS_LINK = '<a href="javascript:window.__xss = 3">click me</a> javascript:window.__xss=4'
HUGE = "A" * 300_000  # one unbroken word, far wider than any screen


@dataclass
class Site:
    proxy: Proxy
    url: str
    plans: dict  # episode id -> demo Plan
    rows: dict[str, list[dict]]  # episode id -> exported trajectory rows, in order
    outcomes: dict[str, str]


def _capture_episodes(proxy: Proxy, loop: LoopThread) -> tuple[dict, dict]:
    plans = {p.id: p for phase in plan_episodes(RUN, 1) for p in phase}
    outcomes = {}
    for plan in plans.values():
        created = register(proxy, plan.id, group_id=plan.group_id, task_id=plan.task.id,
                            harness={"name": "tracetap-demo-agent",
                                     "config": {"variant": plan.variant}})

        async def agent(created=created, plan=plan):
            extra_body = {"mock_tool_rounds": plan.tool_rounds}
            if plan.api == "messages":
                client = anthropic.AsyncAnthropic(
                    base_url=created["base_url"].removesuffix("/v1"),
                    api_key=created["api_key"], max_retries=0)
                async with client:
                    return await run_messages_agent(client, plan.task, model=MODEL)
            client = openai.AsyncOpenAI(base_url=created["base_url"],
                                        api_key=created["api_key"], max_retries=0)
            async with client:
                if plan.api == "responses":
                    return await run_responses_agent(client, plan.task, model=MODEL,
                                                     extra_body=extra_body)
                return await run_agent(client, plan.task, model=MODEL, seed=plan.seed,
                                       rewrite_at=plan.rewrite_at, extra_body=extra_body)

        result = loop.run(agent())
        outcomes[plan.id] = result.outcome()
        finish(proxy, plan.id, result.reward(), rewards={"keywords": result.reward()},
               outcome=result.outcome())
    client = openai.OpenAI(base_url=proxy.episode_url("alts"), api_key="unused", max_retries=0)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                   logprobs=True, top_logprobs=3)
    broken = openai.OpenAI(base_url=proxy.episode_url("broken"), api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError):
        broken.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       extra_body={"mock_status": 500})
    # A hostile agent: markup, script URLs and an oversized word through a real call.
    created = register(proxy, "hostile", task_id="<img src=x onerror=alert(1)>",
                        harness={"name": "<script>window.__xss = 5</script>"})
    hostile = openai.OpenAI(base_url=created["base_url"], api_key=created["api_key"],
                            max_retries=0)
    hostile.chat.completions.create(model=MODEL, messages=[
        {"role": "system", "content": XSS_TEXT},
        {"role": "user", "content": XSS_LINK + " " + HUGE}])
    finish(proxy, "hostile", 0.0, rewards={"keywords": 0.0},
           outcome="</dd><script>window.__xss = 6</script>")
    return plans, outcomes


@contextmanager
def serving(data: Path, token: str) -> Iterator[tuple[Proxy, LoopThread]]:
    """A proxy (SQLite in ``data``, admin token ``token``) in front of the mock engine,
    both on one loop thread, for a browser test module's whole run."""
    loop = LoopThread()
    engine = EngineServer(EngineConfig(model=MODEL))
    loop.run(engine.start())
    settings = Settings(upstream=engine.url, db=f"sqlite:///{data / 'tracetap.db'}",
                        data_dir=str(data), port=free_port(), upstream_flavor="auto",
                        admin_token=token)
    upgrade(settings.database_url)
    proxy = Proxy(loop, settings).start()
    try:
        yield proxy, loop
    finally:
        proxy.stop()
        loop.run(engine.close())
        loop.close()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Iterator[Site]:
    data = tmp_path_factory.mktemp("viewer")
    with serving(data, TOKEN) as (proxy, loop):
        plans, outcomes = _capture_episodes(proxy, loop)
        proxy.flush()
        export(proxy.settings.database_url, data / "export", finished_only=False,
               overwrite=True, datasets=["trajectories"])
        rows: dict[str, list[dict]] = {}
        for row in pq.read_table(data / "export" / "trajectories").to_pylist():
            rows.setdefault(row["episode_id"], []).append(row)
        yield Site(proxy, proxy.url + UI, plans, rows, outcomes)


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
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.dialogs = dialogs
    yield page
    context.close()


def of_variant(site: Site, variant: str) -> list[str]:
    return [i for i, p in site.plans.items() if p.variant == variant]



# (task, baseline reward, candidate reward): t1 and t2 fixed, t3 broken, t4 and t5 unchanged
BATCH = [("t1", 0.0, 1.0), ("t2", 0.0, 1.0), ("t3", 1.0, 0.0), ("t4", 1.0, 1.0),
         ("t5", 0.0, 0.0)]


@pytest.fixture(scope="module")
def variants_site(site) -> Site:
    for task, base, cand in BATCH:
        for harness, reward, retries in (("base-h", base, "1"), ("cand-h", cand, "2")):
            eid = f"v-{harness}-{task}"
            register(site.proxy, eid, task_id=task, metadata={"batch": "h29"},
                      harness={"name": harness, "config": {"ctx": harness[:4],
                                                           "retries": retries}})
            finish(site.proxy, eid, reward, rewards={"keywords": reward},
                   outcome="solved" if reward else "failed")
    return site


def compare_in_thread(site: Site):
    """What `tracetap compare` computes for the same selectors (off Playwright's thread)."""
    from tracetap.analysis.compare import compare
    from tracetap.analysis.episodes import load
    from tracetap.analysis.select import Success, parse_selector
    from tracetap.storage.scan import EpisodeFilter

    def go():
        episodes = load(site.proxy.settings.database_url, EpisodeFilter(), costs=True)
        return compare(episodes, parse_selector("harness=base-h"),
                       [parse_selector("harness=cand-h")], success=Success(("solved",)))

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(go).result()
