"""The trace viewer without a browser: its queries on both databases, the token layout,
sessions, the gate in front of it, and ``tracetap ui``. Pages in Chromium are in
test_viewer_browser.py."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from array import array

import pytest
from helpers.http import get_page
from helpers.loop import free_port
from sqlalchemy import update

from tracetap.migrations import upgrade
from tracetap.proxy.apis.registry import readers
from tracetap.storage import browse, changes, queries
from tracetap.storage.engine import create_engine
from tracetap.storage.records import CallRecord, ChoiceRecord
from tracetap.storage.rows import insert_calls
from tracetap.storage.scan import Reader
from tracetap.storage.tables import Episode
from tracetap.viewer import access, conversation, jsonview, params, tokens
from tracetap.viewer.access import SESSION_SECONDS

UI = "/tracetap/ui"
T0 = 1_700_000_000.0


def _call_record(call_id: str, episode: str, t: float, prompt: list[int], completion: list[int],
          *, status: str = "ok", http: int = 200, tokens_used: int = 10) -> CallRecord:
    choice = ChoiceRecord(index=0, finish_reason="stop", text="x", completion_ids=completion,
                          completion_logprobs=[-0.01 * (i + 1) for i in range(len(completion))],
                          token_source="engine")
    return CallRecord(call_id=call_id, episode_id=episode, endpoint="chat.completions",
                      t_start=t, t_first_byte=t + 0.01, t_end=t + 0.1, status=status,
                      http_status=http, prompt_ids=prompt, prompt_tokens=tokens_used,
                      completion_tokens=len(completion), instance="i",
                      choices=[choice] if status == "ok" and http == 200 else [])


async def _populate(engine) -> None:
    """Six episodes: a group of three, a failed call, a budget refusal, an unfinished one."""
    specs = [  # id, group, task, harness, reward, outcome, created offset
        ("g-1", "grp", "task-a", "h1", 1.0, "solved", 1),
        ("g-2", "grp", "task-a", "h1", 0.0, "failed", 2),
        ("g-3", "grp", "task-a", "h1", 0.5, "partial", 3),
        ("solo", None, "task-b", "h2", None, None, 4),
        ("broken", None, "task-b", "h2", 0.0, "failed", 5),
        ("spent", None, "task-c", "h2", 0.2, "partial", 6),
    ]
    for episode_id, group, task, harness, *_ in specs:
        await queries.create_episode(engine, episode_id=episode_id, key_hash=episode_id,
                                     group_id=group, task_id=task, harness_name=harness,
                                     harness_config=None, metadata=None)
    records = []
    for n, (episode_id, *_rest, offset) in enumerate(specs):
        records.append(_call_record(f"c{n}-0", episode_id, T0 + offset, [1, 2], [3, 4]))
    records.append(_call_record("c-bad", "broken", T0 + 5.5, [1], [], status="ok", http=500))
    records.append(_call_record("c-spent", "spent", T0 + 6.5, [1], [], status="budget_exceeded",
                         http=403))
    # a passthrough (count_tokens) is no failure
    records.append(_call_record("c-pass", "solo", T0 + 4.5, [], [], status="passthrough"))
    records.append(_call_record("c-untagged", None, T0, [], [], http=500))  # failed, in no episode
    await insert_calls(engine, records)
    async with engine.begin() as conn:  # created_at is now(): place episodes in time
        for episode_id, *_rest, offset in specs:
            await conn.execute(update(Episode).where(Episode.id == episode_id)
                               .values(created_at=T0 + offset))
    for episode_id, _g, _t, _h, reward, outcome, _o in specs:
        if outcome is not None:
            await queries.finish_episode(engine, episode_id, reward=reward, rewards=None,
                                         outcome=outcome, info=None)


def _ids(page) -> list[str]:
    return [r.id for r in page.rows]


def test_episode_pages_filter_sort_and_page_on_both_databases(db_url):
    async def run():
        engine = create_engine(db_url)
        try:
            await _populate(engine)
            q = browse.EpisodeQuery

            async def ids(**kw):
                return _ids(await browse.episode_page(engine, q(**kw)))

            assert await ids() == ["spent", "broken", "solo", "g-3", "g-2", "g-1"]
            assert await ids(descending=False) == ["g-1", "g-2", "g-3", "solo", "broken",
                                                   "spent"]
            # Unrewarded last whichever the direction; ties by id.
            assert await ids(sort="reward") == ["g-1", "g-3", "spent", "g-2", "broken",
                                                "solo"]
            assert await ids(sort="reward", descending=False) == [
                "broken", "g-2", "spent", "g-3", "g-1", "solo"]
            assert await ids(search="g-") == ["g-3", "g-2", "g-1"]
            assert await ids(search="%") == []  # a LIKE wildcard is just a character
            assert await ids(group_id="grp", reward_min=0.5) == ["g-3", "g-1"]
            assert await ids(reward_max=0.2, task_id="task-b") == ["broken"]
            assert await ids(harness="h2", finished=False) == ["solo"]
            assert await ids(outcome="failed") == ["broken", "g-2"]
            assert await ids(since=T0 + 2, until=T0 + 4) == ["g-3", "g-2"]
            assert await ids(status="errors") == ["spent", "broken"]
            assert await ids(status="budget_exceeded") == ["spent"]
            assert await ids(status="ok") == ["solo", "g-3", "g-2", "g-1"]
            first = await browse.episode_page(engine, q(limit=4))
            second = await browse.episode_page(engine, q(limit=4, offset=4))
            assert first.total == second.total == 6
            assert _ids(first) + _ids(second) == await ids()
            for sort, descending in (("reward", True), ("reward", False), ("finished", True)):
                # pages past the middle are read backwards: the same rows, nulls included
                paged = [i for offset in (0, 2, 4) for i in await ids(
                    sort=sort, descending=descending, limit=2, offset=offset)]
                assert paged == await ids(sort=sort, descending=descending)
            broken = next(r for r in first.rows if r.id == "broken")
            assert (broken.calls, broken.failed_calls, broken.budget_exceeded) == (2, 1, False)
            solo = next(r for r in first.rows + second.rows if r.id == "solo")
            assert (solo.calls, solo.failed_calls) == (2, 0)
            spent = next(r for r in first.rows if r.id == "spent")
            assert spent.budget_exceeded and spent.completion_tokens == 2

            groups = await browse.group_page(engine, q())
            assert groups.total == 1
            (group,) = groups.rows
            assert [m.id for m in group.members] == ["g-1", "g-2", "g-3"]
            assert group.rewards == [1.0, 0.0, 0.5] and group.task_ids == ["task-a"]

            sample = await browse.chart_sample(engine, q(group_id="grp"), limit=2)
            assert sample.episodes == 2 and sorted(sample.rewards) == [0.0, 0.5]
            assert sample.calls_per_episode == [1, 1] and len(sample.latencies) == 2

            stored = await changes.calls_stored_since(engine, 0.0, 100)
            assert len(stored) == 10
            assert await changes.calls_stored_since(engine, time.time() + 60, 100) == []
            changed = await changes.episodes_changed_since(engine, T0 + 5, 100)
            assert {e.id for e in changed} >= {"broken", "spent", "g-1"}  # created, finished
        finally:
            await engine.dispose()

    asyncio.run(run())


def test_split_rows_locate_the_diverging_tokens(tmp_path):
    """An append-only turn, then a rewritten context: two rows, the split where they part."""
    url = f"sqlite:///{tmp_path / 't.db'}"
    upgrade(url)
    system, question = [1, 2, 3, 4], [5, 6]
    first = _call_record("a", "ep", T0, system + question, [7, 8, 9])
    second = _call_record("b", "ep", T0 + 1, [*system, *question, 7, 8, 9, 10, 11], [12, 13])
    rewritten = _call_record("c", "ep", T0 + 2, [*system, 99, 98], [14])

    async def run():
        engine = create_engine(url)
        await insert_calls(engine, [first, second, rewritten])
        await engine.dispose()
        async with Reader(url, with_bodies=False) as reader:
            return await tokens.episode_rows(reader, "ep")

    rows, calls = asyncio.run(run())
    assert len(calls) == 3 and [r.reason for r in rows] == [None, "non_prefix"]
    main, split = rows
    assert main.ids.tolist() == [*system, *question, 7, 8, 9, 10, 11, 12, 13]
    assert main.trained == 5 and main.mask.count(1) == sum(main.trajectory.response_mask)
    assert [(s.number, s.call_id, s.start, s.end, s.trained) for s in main.spans] == [
        (1, "a", 6, 9, True), (2, "b", 11, 13, True)]
    assert split.split.position == 4 and split.split.partner == 0
    assert split.split.expected == [5, 6, 7, 8, 9, 10, 11, 12]
    assert split.split.received == [99, 98, 14]
    window = tokens.window(main, 5, 6, {7: "seven"}, {})
    kinds = [p.kind for p in window.pieces if isinstance(p, tokens.Token)]
    # the question, turn 1 (trained), the observation; " u": no text known for the id
    assert kinds == ["p u", "s l0", "s l0 u", "s l0 u", "o u", "o u"]
    assert [p.label for p in window.pieces if isinstance(p, tokens.Marker)] == [
        "response starts", "turn 1: call 0"]
    texts = [p.text for p in window.pieces if isinstance(p, tokens.Token)]
    assert texts[:3] == ["[6]", "seven", "[8]"]  # unknown text shows the id
    assert window.data["ids"] == [6, 7, 8, 9, 10, 11]
    assert tokens.overview(main, 4, 5)[1]["current"]


def test_sessions_are_signed_expire_and_die_with_the_token():
    now = time.time()
    value = access.new_session("tok", now)
    assert access.valid_session("tok", value, now + 10)
    assert not access.valid_session("other-token", value, now + 10)
    assert not access.valid_session("tok", value, now + SESSION_SECONDS + 1)
    issued, nonce, mac = value.split(".")
    assert not access.valid_session("tok", f"{int(issued) + 1}.{nonce}.{mac}", now)
    assert not access.valid_session("tok", "garbage", now)
    assert access.safe_next("/tracetap/ui/episodes/x?t=1", UI) == "/tracetap/ui/episodes/x?t=1"
    for bad in ("https://evil.example/", "//evil.example/x", "/tracetap/ui//evil", "/other",
                "/tracetap/ui/\\evil", None):
        assert access.safe_next(bad, UI) == UI + "/"


def test_bodies_hide_credentials_and_are_cut():
    node = jsonview.tree({"api_key": "sk-1", "nested": {"Authorization": "Bearer x"},
                          "text": "a" * (jsonview.STRING_LIMIT + 5), "list": list(range(3))})
    by_key = {c.key: c for c in node.children}
    assert by_key["api_key"].kind == "secret" and "sk-1" not in by_key["api_key"].value
    assert by_key["nested"].children[0].kind == "secret"
    assert by_key["text"].size == 5 and len(by_key["text"].value) == jsonview.STRING_LIMIT
    assert [c.value for c in by_key["list"].children] == ["0", "1", "2"]
    big = jsonview.tree(list(range(jsonview.NODE_LIMIT + 10)))
    assert big.children[-1].kind == "more"


@pytest.mark.parametrize("endpoint,request_body,response_body,expected", [
    ("responses:chat",
     '{"instructions": "be brief", "input": [{"type": "message", "role": "user", "content": '
     '[{"type": "input_text", "text": "hi"}]}, {"type": "function_call", "name": "f", '
     '"arguments": "{\\"a\\":1}", "call_id": "c1"}, {"type": "function_call_output", '
     '"call_id": "c1", "output": "42"}]}',
     '{"output": [{"type": "message", "role": "assistant", "content": [{"type": '
     '"output_text", "text": "done"}]}]}',
     [("system", "be brief"), ("user", "hi"), ("assistant", ""), ("tool", "42"),
      ("assistant", "done")]),
    ("messages:chat",
     '{"system": "sys", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", '
     '"content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]}, '
     '{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": '
     '"42"}]}]}',
     '{"role": "assistant", "content": [{"type": "text", "text": "done"}]}',
     [("system", "sys"), ("user", "q"), ("assistant", ""), ("tool", "42"),
      ("assistant", "done")]),
    ("completions", '{"prompt": "say"}', '{"choices": [{"text": " it"}]}',
     [("prompt", "say"), ("reply", " it")]),
    ("chat.completions", "not json", None, [("other", "not json")]),
])
def test_conversations_read_each_api_in_its_own_shape(endpoint, request_body, response_body,
                                                      expected):
    turns = conversation.turns(readers(), endpoint, request_body, response_body)
    assert [(t.role, t.text) for t in turns] == expected
    calls = [c for t in turns for c in t.tool_calls]
    if calls:
        assert calls[0].name == "f" and '"a": 1' in calls[0].arguments
        assert turns[-1].reply


def test_bad_filters_are_named():
    with pytest.raises(params.BadParameter, match="reward_min"):
        params.episode_query({"reward_min": "lots"})
    with pytest.raises(params.BadParameter, match="status"):
        params.episode_query({"status": "weird"})
    query = params.episode_query({"since": "2023-11-14T22:13", "page": "3", "limit": "25"})
    assert query.since == 1699999980.0 and query.offset == 50


def test_the_proxy_serves_the_viewer_only_to_its_admin_token(proxy):
    created = proxy.admin("POST", "/tracetap/episodes", {"id": "ep-1"})[1]
    status, headers, _ = get_page(proxy.url + UI + "/")
    assert status == 303 and headers["Location"].startswith(UI + "/login?next=")
    assert get_page(proxy.url + UI + "/", accept="*/*")[0] == 401
    assert get_page(proxy.url + UI + "/", token="wrong")[0] == 303
    status, _, body = get_page(proxy.url + UI + "/", token=created["api_key"])
    assert status == 403 and "Episode API keys" in body
    status, headers, body = get_page(proxy.url + UI + "/", token=proxy.admin_token)
    assert status == 200 and "ep-1" in body
    assert "unsafe-inline" not in headers["Content-Security-Policy"]
    assert headers["X-Frame-Options"] == "DENY"
    status, _, body = get_page(proxy.url + UI + "/?reward_min=lots", token=proxy.admin_token)
    assert status == 400 and "reward_min must be a number" in body
    assert get_page(proxy.url + UI + "/episodes/nope", token=proxy.admin_token)[0] == 404
    status, _, body = get_page(proxy.url + UI + "/static/app.js")  # assets need no session
    assert status == 200 and "textContent" in body


def test_with_an_admin_listener_the_agent_port_has_no_viewer(loop_thread, engine, tmp_path):
    from aiohttp import web
    from helpers.servers import Proxy

    from tracetap.proxy.runtime.settings import Settings

    admin_port = free_port()
    settings = Settings(upstream=engine.url, data_dir=str(tmp_path), port=free_port(),
                        admin_port=admin_port, upstream_flavor="openai", admin_token="T0k")
    upgrade(settings.database_url)
    proxy = Proxy(loop_thread, settings).start()
    try:
        loop_thread.run(web.TCPSite(proxy.runner, "127.0.0.1", admin_port).start())
        assert get_page(proxy.url + UI + "/", token="T0k")[0] == 404
        assert get_page(proxy.url + UI + "/login")[0] == 404
        status, _, body = get_page(f"http://127.0.0.1:{admin_port}{UI}/", token="T0k")
        assert status == 200 and "No episodes yet" in body
    finally:
        proxy.stop()


def test_tracetap_ui_browses_a_database_without_a_proxy(tmp_path, db_url):
    async def fill():
        engine = create_engine(db_url)
        await _populate(engine)
        await engine.dispose()

    asyncio.run(fill())
    port = free_port()
    log = tmp_path / "ui.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "tracetap", "ui", "--db", db_url, "--port", str(port),
             "--data-dir", str(tmp_path / "data")], stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}{UI}/"
        deadline = time.monotonic() + 30
        while True:
            try:
                status = get_page(url, accept="*/*")[0]
                break
            except OSError:
                assert process.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)  # polling for readiness
        assert status == 401
        token = (tmp_path / "data" / "admin-token").read_text().strip()
        status, _, body = get_page(url + "?group=grp", token=token)
        assert status == 200 and "g-1" in body and "solo" not in body
        status, _, body = get_page(url.replace(UI + "/", UI + "/episodes/g-1"), token=token)
        assert status == 200 and "task-a" in body
        assert "admin-token" in log.read_text()
    finally:
        process.terminate()
        process.wait(30)


def test_tracetap_ui_says_what_is_wrong_with_the_database(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tracetap", "ui", "--db",
                           f"sqlite:///{tmp_path / 'missing.db'}"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "no database at" in done.stderr
    empty = tmp_path / "empty.db"
    empty.touch()
    done = subprocess.run([sys.executable, "-m", "tracetap", "ui", "--db",
                           f"sqlite:///{empty}"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "tracetap db upgrade" in done.stderr


def test_trajectory_arrays_are_shown_as_exported():
    """Row keeps the exporter's arrays: prompt then response, logprobs 0 on the prompt."""
    from tracetap.exporters.trajectories import build_trajectories
    from tracetap.storage.scan import ScannedCall, ScannedChoice

    call = ScannedCall(call_id="a", prompt_ids=array("i", [1, 2]).tobytes(), t_end=1.0,
                       choices=[ScannedChoice(completion_ids=array("i", [3]).tobytes(),
                                              completion_logprobs=array("d", [-2.0]).tobytes(),
                                              token_source="engine")])
    (trajectory,) = build_trajectories([call])
    row = tokens.Row(0, trajectory, {"a": call})
    assert row.ids.tolist() == [1, 2, 3] and row.mask == b"\x00\x00\x01"
    assert row.logprobs.tolist() == [0.0, 0.0, -2.0]
    assert tokens.window(row, 0, 10, {}, {}).pieces[-1].kind == "s l3 u"


def test_ui_bench_stays_runnable(postgres):
    done = subprocess.run(
        [sys.executable, "bench/ui_bench.py", "--episodes", "300", "--rounds", "2",
         "--big-calls", "4", "--big-tokens", "400"], capture_output=True, text=True,
        timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["episodes"] == 300
    pages = figures["results"]
    sizes = {name: pages.pop(name) for name in ("long bytes", "big bytes")}
    assert len(pages) == 16 and all(r["p50"] > 0 for r in pages.values())
    assert all(0 < sent < html for sent, html in sizes.values())  # pages go compressed
    assert "episodes pages: worst p95" in done.stdout


def test_row_cache_reuses_rows_until_the_episode_changes(tmp_path):
    from tracetap.viewer.rowcache import RowCache

    url = f"sqlite:///{tmp_path / 'c.db'}"
    upgrade(url)

    async def run():
        engine = create_engine(url)
        await insert_calls(engine, [_call_record("a", "ep", T0, [1, 2], [3]),
                                    _call_record("x", "other", T0, [1, 2, 3, 4], [5])])
        cache = RowCache(max_tokens=8)
        async with Reader(url, with_bodies=False) as reader:
            first = await cache.rows(reader, "ep")
            assert await cache.rows(reader, "ep") is first  # unchanged: the same rows
            await insert_calls(engine, [_call_record("b", "ep", T0 + 1, [1, 2, 3, 9], [7])])
            second = await cache.rows(reader, "ep")
            assert second is not first and second[0].ids.tolist() == [1, 2, 3, 9, 7]
            await cache.rows(reader, "other")  # 5 + 5 tokens > 8: "ep" is evicted
            assert list(cache.items) == ["other"] and cache.tokens == 5
        await engine.dispose()

    asyncio.run(run())


def test_an_unreadable_database_is_a_503_page_not_a_crash(serve_app, tmp_path):
    from tracetap.viewer.access import Access
    from tracetap.viewer.app import ViewerConfig, build_viewer

    config = ViewerConfig(database_url=f"sqlite:///{tmp_path / 'gone.db'}")
    url = serve_app(build_viewer(config, Access(lambda _request: "tok"), readers(),
                                 mounted=False))
    status, _, body = get_page(url + UI + "/", token="tok")
    assert status == 503 and "no database at" in body


def test_demo_ui_keeps_the_viewer_up_and_says_where_to_look(tmp_path):
    demo = subprocess.Popen(
        [sys.executable, "-m", "tracetap", "demo", "--ui", "--quiet", "--episodes", "0",
         "--data-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    printed = []
    try:
        for line in demo.stdout:
            printed.append(line)
            if "Ctrl-C" in line:
                break
        text = "".join(printed)
        token = re.search(r"admin token: (\S+)", text).group(1)
        failed = re.search(r"failed episodes:\s+(\S+)", text).group(1)
        split = re.search(r"why the rewrite split:\s+(\S+)", text).group(1)
        status, _, body = get_page(failed, token=token)
        assert status == 200 and 'class="id"' in body
        assert all(o == "failed" for o in re.findall(r"<td>(solved|partial|failed)</td>", body))
        status, _, body = get_page(split.split("#")[0], token=token)
        assert status == 200 and "Why row 2 split: <code>non_prefix</code>" in body
        demo.terminate()
        assert demo.wait(30) == 0
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        demo.stdout.close()
