"""Real harnesses, as they ship, through tracetap against the mock engine.

Each pinned CLI and framework (tests/harness_matrix/versions.txt, installed once by
tests/harness_matrix/install.sh, which .ci/run calls) runs one small task ("read
notes.txt and answer") as its own episode. The engine calls a tool on the first turn
with no text before the call (the bare tool-call turn is the hardest case for logprobs),
so every episode has at least two calls. Then: every call is captured with token ids and
logprobs for its whole completion, and the episode exports as one trajectory or splits
with a named cause (exporters.history.CAUSES, or sample/retry/branch), among those
docs/harnesses.md gives for that harness. A harness release that changes the shape of
its requests or how it resends its history turns this red. Claude Code's ``/compact`` and
Codex's auto-compaction run as episodes of their own, whose export must link the
segments before and after the compaction (docs/export.md, "Compacted conversations").

Skipped when the harnesses are not installed, except in CI, where it fails.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow.parquet as pq
import pytest
from aiohttp import web
from helpers.loop import LoopThread, free_port
from helpers.servers import Proxy

from tests.harness_matrix import runs, steer
from tests.test_compaction import assert_trained_once
from tracetap.demo.engine import EngineConfig, EngineServer
from tracetap.exporters import export
from tracetap.exporters.history import CAUSES
from tracetap.migrations import upgrade
from tracetap.proxy.runtime.settings import Settings

# A harness run is a few seconds; this is for a harness that hangs (waiting on a
# prompt, or retrying a refused request with back-off).
RUN_TIMEOUT_S = 180
# Runs at once (module fixture `launched`); the processes mostly wait, even on 2 cores.
LAUNCH_WORKERS = 4
OTHER_SPLITS = {"sample", "retry", "branch", "compaction"}


@dataclass(frozen=True)
class Harness:
    run: Callable[[runs.Place], runs.Run]
    package: str  # its name in versions.txt
    # tracetap serve's settings beyond the matrix's own: ("translate", "all") is what an
    # engine without native Responses (SGLang, llama.cpp) gets.
    serve: tuple[tuple[str, object], ...] = ()
    # The causes its rows may split by (docs/harnesses.md says why); a release that
    # resends its history another way shows a new one. None: not checked (below).
    splits: frozenset[str] | None = frozenset()
    # The conversations its episode holds (exporters.lineages): a title call, a final
    # answer asked for in a conversation of its own.
    lineages: int = 1
    # It starts sub-agents: at least two lineages, one root, each other one's parent in
    # the episode (their number varies: a sub-agent may start its own).
    sub_agents: bool = False


# Claude Code resends tool input with its keys in schema order; when that is not the
# order the model wrote them in, the next prompt's tokens differ, and the split reads as
# template_drift (the stored Messages reply has the input as a value, with no spelling).
HARNESSES = {
    "claude-code": Harness(runs.claude_code, "@anthropic-ai/claude-code",
                           splits=frozenset({"template_drift"})),
    # An explicit older model: another request shape of the same release.
    "claude-code-sonnet-4-5": Harness(lambda p: runs.claude_code(p, "claude-sonnet-4-5"),
                                      "@anthropic-ai/claude-code",
                                      splits=frozenset({"template_drift"})),
    # Its Agent tool left in (the engine is steered to start a real sub-agent): each
    # sub-agent's turns are a lineage of their own under the one that started it. Its
    # splits are not checked: how many sub-agents start, and with which prompts, varies
    # from run to run, and two sub-agents of one type (the same system prompt) started one
    # after the other read as one rewritten conversation (docs/export.md, lineages), split
    # by whatever differs (seen: branch, retry, assistant_turn_dropped, history_compacted).
    # The plain claude-code entries check its splits.
    "claude-code-agents": Harness(runs.claude_code_agents, "@anthropic-ai/claude-code",
                                  serve=(("steer_agents", True),), splits=None,
                                  sub_agents=True),
    # Under --translate auto its tool-offering Responses calls go to the engine as chat
    # (a bare tool-call turn keeps its logprobs); --translate all translates every call.
    "codex": Harness(runs.codex, "@openai/codex"),
    "codex-translated": Harness(runs.codex, "@openai/codex", serve=(("translate", "all"),)),
    "qwen-code": Harness(runs.qwen_code, "@qwen-code/qwen-code"),
    # Its first call writes the session's title: a conversation of its own, so a lineage
    # of its own (it was a system_changed split of the main line before lineages).
    "opencode": Harness(runs.opencode, "opencode-ai", lineages=2),
    "openai-agents": Harness(runs.framework("openai-agents"), "openai-agents"),
    "openai-agents-translated": Harness(runs.framework("openai-agents"), "openai-agents",
                                        serve=(("translate", "all"),)),
    "langchain-openai": Harness(runs.framework("langchain-openai"), "langchain-openai",
                                splits=frozenset({"tool_args_reserialized"})),
    # Its re-serialised tool arguments split the episode; history repair undoes that.
    "langchain-openai-repaired": Harness(runs.framework("langchain-openai"), "langchain-openai",
                                         serve=(("repair_history", True),)),
    "pydantic-ai": Harness(runs.framework("pydantic-ai"), "pydantic-ai-slim[openai]"),
    # Tool calls resent as text parts; the final answer asked for in a new conversation
    # (a lineage of its own; a system_changed split before lineages).
    "smolagents": Harness(runs.framework("smolagents"), "smolagents",
                          splits=frozenset({"content_parts"}), lineages=2),
}


@pytest.fixture(scope="module")
def tools() -> Path:
    found = runs.install_dir()
    if not (found / ".installed").exists():
        if os.environ.get("CI"):
            pytest.fail(f"the pinned harnesses are not installed in {found}; .ci/run runs "
                        "tests/harness_matrix/install.sh")
        pytest.skip("harnesses not installed (run tests/harness_matrix/install.sh)")
    return found


@pytest.fixture(scope="module")
def proxies(tmp_path_factory) -> Iterator[dict[tuple, Proxy]]:
    """The mock engine (one bare tool call, then an answer) behind tracetap on SQLite,
    once per set of serve settings the harnesses use."""
    loop = LoopThread()
    # A tool call's arguments come from the harness's schema with random values: Codex's
    # exec_command has ten of them, which some seeds spell in more than the engine's
    # default 256 tokens (an incomplete reply Codex gives up on). The harnesses set no cap.
    engine = EngineServer(EngineConfig(flavor="vllm", tool_rounds=1, tool_preface=0.0,
                                       max_tokens_default=2048))
    loop.run(engine.start())
    started = {}
    steering = web.AppRunner(steer.app(engine.url))
    steer_port = free_port()

    async def start_steering():
        await steering.setup()
        await web.TCPSite(steering, "127.0.0.1", steer_port).start()

    loop.run(start_steering())
    steered = f"http://127.0.0.1:{steer_port}{urlsplit(engine.url).path}"
    for serve in {h.serve for h in HARNESSES.values()}:
        data = tmp_path_factory.mktemp("matrix")
        db = f"sqlite:///{data / 'tracetap.db'}"
        upgrade(db)
        options = dict(serve)
        upstream = steered if options.pop("steer_agents", False) else engine.url
        settings = Settings(upstream=upstream, db=db, data_dir=str(data / "data"),
                            port=free_port(), model_map=["claude-*=mock-model"], **options)
        started[serve] = Proxy(loop, settings).start()
    yield started
    for proxy in started.values():
        proxy.stop()
    loop.run(steering.cleanup())
    loop.run(engine.close())
    loop.close()


@dataclass(frozen=True)
class Ran:
    place: runs.Place
    code: int | None  # None: still running at RUN_TIMEOUT_S, then killed
    output: str


def run_harness(name: str, tools: Path, proxy: Proxy, folder: Path) -> Ran:
    """Register the harness's episode, run it on the task, return how it ended."""
    episode = f"matrix-{name}"
    status, body = proxy.admin("POST", "/tracetap/episodes",
                               {"id": episode, "harness": {"name": name}})
    if status != 201:
        raise RuntimeError(f"registering {episode}: {status} {body}")
    place = runs.Place(tools=tools, proxy=proxy.url, episode=episode, home=folder / "home",
                       work=folder / "work", episode_url=body["base_url"].removesuffix("/v1"))
    place.home.mkdir()
    place.work.mkdir()
    (place.work / "notes.txt").write_text(runs.NOTES)
    run = HARNESSES[name].run(place)
    try:
        done = subprocess.run(run.argv, env=run.env, cwd=place.work, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
        return Ran(place, None, out)
    return Ran(place, done.returncode, done.stdout + done.stderr)


@pytest.fixture(scope="module")
def launched(request, tools, proxies, tmp_path_factory) -> Iterator[dict[str, Future]]:
    """Every selected harness, started at once: a run mostly waits (on its runtime's
    start, on the proxy), so the matrix takes about its slowest run, not their sum."""
    names = [item.callspec.params["name"] for item in request.session.items
             if item.module is request.module and hasattr(item, "callspec")
             and "name" in item.callspec.params]
    with ThreadPoolExecutor(max_workers=LAUNCH_WORKERS) as pool:
        yield {name: pool.submit(run_harness, name, tools, proxies[HARNESSES[name].serve],
                                 tmp_path_factory.mktemp(name))
               for name in names}


def assert_captured(calls: list[dict]) -> None:
    """Every call stored whole: ok, prompt ids, and ids + logprobs for each completion."""
    assert len(calls) >= 2, f"a tool round trip is at least two calls, got {len(calls)}"
    assert any(c["finish_reason"] == "tool_calls" for call in calls for c in call["choices"])
    for call in calls:
        where = f"call {call['seq']} ({call['endpoint']})"
        assert call["status"] == "ok" and call["http_status"] == 200, (where, call["error"])
        assert call["prompt_ids"] and call["prompt_source"] == "engine", where
        assert call["choices"], where
        for choice in call["choices"]:
            ids, logprobs = choice["completion_ids"], choice["completion_logprobs"]
            assert ids and choice["token_source"] == "engine", where
            assert logprobs is not None and len(logprobs) == len(ids), where


def assert_trajectories(rows: list[dict], calls: list[dict]) -> None:
    """One main line per lineage; every other row says why it split, by a named cause."""
    lineages = {r["lineage_id"] for r in rows}
    assert [r["split_reason"] for r in rows].count(None) == len(lineages), rows
    for row in rows:
        if row["split_reason"] == "non_prefix":
            assert row["drift_cause"] in CAUSES and row["drift_cause"] != "unknown", row
        elif row["split_reason"] is not None:
            assert row["split_reason"] in OTHER_SPLITS, row["split_reason"]
    exported = {cid for r in rows for cid in r["call_ids"]}
    assert exported == {c["call_id"] for c in calls}


@pytest.mark.parametrize("name", list(HARNESSES))
def test_harness_through_tracetap(name, launched, proxies, tmp_path):
    harness = HARNESSES[name]
    proxy = proxies[harness.serve]
    assert harness.package in runs.pinned()
    ran = launched[name].result()
    if ran.code is None:
        pytest.fail(f"{name} still running after {RUN_TIMEOUT_S} s:\n{ran.output[-3000:]}")
    episode = ran.place.episode
    calls = proxy.calls(episode)
    assert ran.code == 0, ran.output[-3000:]
    assert_captured(calls)

    assert proxy.admin("POST", f"/tracetap/episodes/{episode}/finish", {"reward": 1.0})[0] == 200
    summary = export(proxy.settings.db, tmp_path / "out", episodes=[episode])
    assert summary.left_out == {}, summary.left_out
    rows = pq.read_table(tmp_path / "out" / "trajectories").to_pylist()
    assert_trajectories(rows, calls)
    causes = {r["drift_cause"] or r["split_reason"] for r in rows if r["split_reason"]}
    assert harness.splits is None or causes <= harness.splits, causes
    assert_lineages(rows, harness)


def assert_lineages(rows: list[dict], harness: Harness) -> None:
    """Its side conversations and sub-agents land in lineages of their own."""
    lineages = {r["lineage_id"]: r["parent_lineage_id"] for r in rows}
    if not harness.sub_agents:
        assert len(lineages) == harness.lineages, rows
        return
    roots = [lineage for lineage, parent in lineages.items() if parent is None]
    assert len(lineages) >= 2 and len(roots) == 1, lineages
    assert all(parent in lineages for parent in lineages.values() if parent), lineages


# Harnesses whose compaction can be driven without a terminal: their runs (one after the
# other, in one working directory), the serve settings, and a text of the prompt with
# which the harness asks for its summary.
COMPACTING = {
    # /compact between two prompts of one session (--continue); its system prompt's
    # billing header changes at the compaction.
    "claude-code": (runs.claude_code_compacted, (), "<summary>"),
    # Auto-compaction under a small model_auto_compact_token_limit (steer.py ends the
    # turn after it).
    "codex": (lambda place: [runs.codex_compacted(place)], (("steer_agents", True),),
              "CONTEXT CHECKPOINT COMPACTION"),
}


@pytest.mark.parametrize("compacting", list(COMPACTING))
def test_a_compaction_exports_linked_segments(compacting, tools, proxies, tmp_path_factory):
    """The turns after the compaction continue the conversation's lineage; their first
    row says ``compaction`` and links the row it continues and the call that wrote the
    summary, a lineage of its own; every sampled token is trained once."""
    make_runs, serve, asks = COMPACTING[compacting]
    proxy, folder = proxies[serve], tmp_path_factory.mktemp(f"{compacting}-compact")
    episode = f"matrix-{compacting}-compact"
    status, body = proxy.admin("POST", "/tracetap/episodes", {"id": episode})
    assert status == 201, body
    place = runs.Place(tools=tools, proxy=proxy.url, episode=episode, home=folder / "home",
                       work=folder / "work", episode_url=body["base_url"].removesuffix("/v1"))
    place.home.mkdir()
    place.work.mkdir()
    (place.work / "notes.txt").write_text(runs.NOTES)
    for run in make_runs(place):
        done = subprocess.run(run.argv, env=run.env, cwd=place.work, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        assert done.returncode == 0, (run.argv, done.stdout[-2000:], done.stderr[-2000:])
    calls = proxy.calls(episode)
    assert_captured(calls)
    assert proxy.admin("POST", f"/tracetap/episodes/{episode}/finish", {"reward": 1.0})[0] == 200
    out = folder / "out"
    summary = export(proxy.settings.db, out, episodes=[episode])
    rows = pq.read_table(out / "trajectories").to_pylist()
    assert_trajectories(rows, calls)
    seq = {c["call_id"]: c["seq"] for c in calls}
    shown = [([seq[c] for c in r["call_ids"]], r["split_reason"], r["drift_cause"],
              seq.get(r["summary_call_id"]), seq[r["lineage_id"]]) for r in rows]
    assert [r["split_reason"] for r in rows].count("compaction") == 1, shown
    [segment] = [r for r in rows if r["split_reason"] == "compaction"]
    asked = next(c for c in calls if c["call_id"] == segment["summary_call_id"])
    assert asks in asked["request"], shown  # the call the harness asked for its summary
    [written] = [r for r in rows if r["call_ids"] == [asked["call_id"]]]
    assert written["split_reason"] is None and written["lineage_id"] == asked["call_id"]
    assert written["parent_lineage_id"] == segment["lineage_id"]
    # The row it continues: the conversation's, up to the last call before the summary's.
    main = next(r for r in rows if r["trajectory_id"] == segment["continues_trajectory_id"])
    assert main["lineage_id"] == segment["lineage_id"] == calls[0]["call_id"]
    assert main["parent_lineage_id"] is None and seq[main["call_ids"][-1]] == seq[
        asked["call_id"]] - 1
    # The turns after the compaction stay in the conversation's lineage, rows of their
    # own from the compaction row on.
    start = seq[segment["call_ids"][0]]
    after = [r for r in rows if seq[r["call_ids"][0]] >= start]
    assert {r["lineage_id"] for r in after} == {segment["lineage_id"]}, shown
    assert {seq[c] for r in after for c in r["call_ids"]} == set(range(start, len(calls)))
    assert summary.splits.get("compaction") == 1
    assert_trained_once(rows, pq.read_table(out / "calls").to_pylist())
