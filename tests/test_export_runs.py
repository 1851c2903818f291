"""Export runs on a database filled directly: what one run writes and counts, and what
the incremental watermark promises (docs/export.md, "What is on disk").

Episodes are written straight into the database (the writer's own insert), and their
finished_at set by hand where a test needs a commit that landed late. The end-to-end
export tests, through the proxy, are in test_export.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from sqlalchemy import text

from tracetap import cli
from tracetap.exporters import ExportError, export
from tracetap.proxy.episodes.ids import uuid7
from tracetap.storage import queries
from tracetap.storage.engine import create_engine
from tracetap.storage.records import CallRecord, ChoiceRecord
from tracetap.storage.rows import insert_calls

SETTLE = 60.0  # "trails the newest exported finished_at by a minute"


def _db(url: str, *steps):
    """Run ``steps`` (coroutine functions of an engine) in order on one engine."""

    async def run():
        engine = create_engine(url)
        try:
            for step in steps:
                await step(engine)
        finally:
            await engine.dispose()

    asyncio.run(run())


def calls(episode: str | None, turns: int = 2, last_n: int = 1):
    """``turns`` append-only calls; the last one has ``last_n`` choices."""
    async def step(engine):
        prompt = [1, 2, 3]
        records = []
        now = time.time()
        for seq in range(turns):
            n = last_n if seq == turns - 1 else 1
            choices = [ChoiceRecord(index=i, finish_reason="stop",
                                    completion_ids=[10 + seq, 20 + seq + i],
                                    completion_logprobs=[-0.5, -0.25], token_source="engine")
                       for i in range(n)]
            records.append(CallRecord(
                call_id=uuid7(), episode_id=episode, seq=seq, endpoint="chat.completions",
                t_start=now + seq, t_end=now + seq + 0.5, http_status=200, prompt_ids=prompt,
                request=f'{{"turn": {seq}}}', response=f'{{"reply": {seq}}}',
                choices=choices))
            prompt = prompt + choices[0].completion_ids + [7]
        await insert_calls(engine, records)
    return step


def finish(episode: str, reward: float, at: float | None = None):
    async def step(engine):
        await queries.finish_episode(engine, episode, reward=reward, rewards=None,
                                     outcome=None, info=None)
        if at is not None:  # stamped then, committed now
            async with engine.begin() as conn:
                await conn.execute(text("UPDATE episodes SET finished_at = :at WHERE id = :id"),
                                   {"at": at, "id": episode})
    return step


def finished_at(url: str, episode: str) -> float:
    found = []

    async def step(engine):
        found.append((await queries.get_episode(engine, episode))["finished_at"])

    _db(url, step)
    return found[0]


def manifest(out: Path) -> dict:
    return json.loads((out / "_manifest.json").read_text())


def run_rows(out: Path, run: int, dataset: str = "trajectories") -> list[dict]:
    """The rows one run wrote (runs are numbered from 0)."""
    files = [f for f in manifest(out)["runs"][run]["files"] if f.startswith(dataset + "/")]
    return [row for f in files for row in pq.read_table(out / f).to_pylist()]


def episodes_of(out: Path, run: int) -> list[tuple[str, float]]:
    return sorted((r["episode_id"], r["reward"]) for r in run_rows(out, run))


def test_a_refinished_episode_is_exported_again_with_its_new_reward(db_url, tmp_path):
    out = tmp_path / "out"
    _db(db_url, calls("a"), calls("b"), finish("a", 0.0), finish("b", 0.5))
    assert export(db_url, out, incremental=True).episodes == 2
    first = finished_at(db_url, "a")
    _db(db_url, finish("a", 1.0, at=first + 1))  # graded again, inside the window
    second = export(db_url, out, incremental=True)
    assert second.episodes == 1 and episodes_of(out, 1) == [("a", 1.0)]
    assert {r["reward"] for r in run_rows(out, 1, "calls")} == {1.0}
    assert export(db_url, out, incremental=True).episodes == 0  # and not a third time
    _db(db_url, finish("b", 0.75, at=first + 2 * SETTLE))  # long after: past the window
    assert episodes_of(out, 2) == [] and export(db_url, out, incremental=True).episodes == 1
    assert episodes_of(out, 3) == [("b", 0.75)]
    assert export(db_url, out, incremental=True).episodes == 0  # remembered, not repeated


def test_a_late_commit_inside_the_window_is_exported_exactly_once(db_url, tmp_path):
    out = tmp_path / "out"
    _db(db_url, calls("early"), calls("late"), calls("too-late"), finish("early", 1.0))
    export(db_url, out, incremental=True)
    newest = finished_at(db_url, "early")
    # Two finishes stamped before the one exported, committed only after the export.
    _db(db_url, finish("late", 0.5, at=newest - SETTLE + 1),
        finish("too-late", 0.0, at=newest - SETTLE - 1))
    assert export(db_url, out, incremental=True).episodes == 1
    assert episodes_of(out, 1) == [("late", 0.5)]  # "early" is not written twice
    assert export(db_url, out, incremental=True).episodes == 0
    # A commit later than the window is documented to be missed: the window is a minute.
    assert "too-late" not in {r["episode_id"] for r in pq.read_table(out / "trajectories")
                              .to_pylist()}


def test_the_manifest_keeps_the_watermark_a_minute_behind_and_only_that_minute(db_url,
                                                                                 tmp_path):
    out = tmp_path / "out"
    _db(db_url, *(calls(e, 1) for e in ("old", "mid", "new")), finish("new", 1.0))
    t = finished_at(db_url, "new")
    _db(db_url, finish("old", 1.0, at=t - 100), finish("mid", 1.0, at=t - 30))
    summary = export(db_url, out, incremental=True)
    assert summary.watermark == manifest(out)["watermark"] == t - SETTLE
    assert manifest(out)["recent"] == {"mid": t - 30, "new": t}

    export(db_url, out, incremental=True)  # nothing new: the watermark stays
    assert manifest(out)["watermark"] == t - SETTLE
    assert manifest(out)["recent"] == {"mid": t - 30, "new": t}

    _db(db_url, calls("next", 1), finish("next", 1.0, at=t + 100))
    assert export(db_url, out, incremental=True).episodes == 1
    assert manifest(out)["watermark"] == t + 100 - SETTLE
    assert manifest(out)["recent"] == {"next": t + 100}

    _db(db_url, calls("back", 1), finish("back", 1.0, at=t + 50))  # late, inside the window
    assert export(db_url, out, incremental=True).episodes == 1
    assert manifest(out)["watermark"] == t + 100 - SETTLE  # never moves back
    assert manifest(out)["recent"] == {"next": t + 100, "back": t + 50}


def test_an_empty_first_run_keeps_no_watermark_and_the_next_run_exports_all(db_url,
                                                                             tmp_path):
    out = tmp_path / "out"
    assert export(db_url, out, incremental=True).watermark is None
    assert manifest(out)["watermark"] is None and manifest(out)["recent"] == {}
    _db(db_url, calls("a"), finish("a", 1.0, at=5.0), calls("b"), finish("b", 1.0, at=7.0))
    assert export(db_url, out, incremental=True).episodes == 2
    assert manifest(out)["watermark"] == 7.0 - SETTLE


def test_a_second_export_into_the_same_directory_is_refused_while_one_runs(db_url,
                                                                          tmp_path):
    out = tmp_path / "out"
    _db(db_url, calls("a"), finish("a", 1.0))
    second: list = []

    def attempt() -> None:
        try:
            second.append(export(db_url, out, incremental=True))
        except ExportError as exc:
            second.append(exc)

    def while_running(progress) -> None:  # the first export's progress callback
        if not second:
            thread = threading.Thread(target=attempt)
            thread.start()
            thread.join(60)

    assert export(db_url, out, incremental=True, progress=while_running).episodes == 1
    [refused] = second
    assert isinstance(refused, ExportError), "a second export ran alongside the first"
    assert str(refused) == f"another export is writing to {out}"
    assert len(manifest(out)["runs"]) == 1
    assert export(db_url, out, incremental=True).episodes == 0  # the lock was let go


def test_incremental_needs_finished_only_and_no_overwrite(db_url, tmp_path):
    with pytest.raises(ExportError) as unfinished:
        export(db_url, tmp_path / "a", incremental=True, finished_only=False)
    assert str(unfinished.value) == (
        "--incremental needs --finished-only: an unfinished episode can still grow, so it "
        "cannot be exported once and for all")
    with pytest.raises(ExportError) as both:
        export(db_url, tmp_path / "b", incremental=True, overwrite=True)
    assert str(both.value) == "--incremental and --overwrite contradict each other"
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_an_episode_finished_exactly_a_minute_before_the_newest_is_written_once(db_url,
                                                                              tmp_path):
    out = tmp_path / "out"
    _db(db_url, calls("a-new", 1), calls("b-old", 1), finish("a-new", 1.0))
    t = finished_at(db_url, "a-new")
    _db(db_url, finish("b-old", 1.0, at=t - SETTLE))  # on the watermark itself
    assert export(db_url, out, incremental=True).episodes == 2
    assert manifest(out)["recent"] == {"a-new": t, "b-old": t - SETTLE}
    assert export(db_url, out, incremental=True).episodes == 0


# ---- one run: what it writes and what it counts ---------------------------------------------

def _filled(url: str) -> None:
    _db(url, calls("e1"), calls("e2", last_n=2), calls("open", 1), calls(None, 1),
        finish("e1", 1.0), finish("e2", 0.5))


def test_the_summary_line_gives_each_dataset_its_figures_from_the_files(db_url, tmp_path,
                                                                        capsys):
    _filled(db_url)
    out = tmp_path / "out"
    assert cli.main(["export", "--db", db_url, "--out", str(out), "--no-progress",
                     "--episode", "e1"]) == 0
    call_rows = pq.read_table(out / "calls").to_pylist()
    [row] = pq.read_table(out / "trajectories").to_pylist()
    call_ids = sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in call_rows)
    trajectory_ids = len(row["prompt_ids"]) + len(row["response_ids"])
    line = capsys.readouterr().out.strip()
    assert line.startswith(
        f"exported 1 episode: 2 calls ({call_ids} token ids), 1 trajectory "
        f"({trajectory_ids} token ids, {sum(row['response_mask'])} trained), 2 files in ")
    assert line.endswith(f" -> {out}")
    assert cli.main(["export", "--db", db_url, "--out", str(out), "--overwrite",
                     "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith("exported 2 episodes: 4 calls (")


def test_episodes_not_found_or_not_finished_are_named_and_nothing_is_written(db_url, tmp_path,
                                                                            capsys):
    _filled(db_url)
    out = tmp_path / "out"
    command = ["export", "--db", db_url, "--out", str(out), "--no-progress"]
    assert cli.main([*command, "--episode", "typo", "--episode", "open"]) == 1
    err = capsys.readouterr().err
    assert err == ("tracetap export: error: nothing exported: 1 episode 'typo' not found in "
                   "the database; 1 episode 'open' not finished (finish with POST "
                   "/tracetap/episodes/{id}/finish, or add --no-finished-only to export "
                   "unfinished episodes)\n")
    assert not out.exists()  # not even an empty directory

    assert cli.main([*command, "--episode", "e1"]) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert cli.main([*command, "--incremental", "--episode", "x", "--episode", "y"]) == 1
    assert "2 episodes 'x', 'y' not found" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before

    assert cli.main([*command, "--overwrite", "--no-finished-only", "--episode", "open",
                     "--episode", "typo"]) == 0  # the unfinished one, as asked
    captured = capsys.readouterr()
    assert captured.out.startswith("exported 1 episode: 1 call (")
    assert captured.err == ("tracetap export: not exported: 1 episode 'typo' not found in "
                            "the database\n")
    assert {r["episode_id"] for r in pq.read_table(out / "calls").to_pylist()} == {"open"}


def test_the_summary_and_the_progress_count_what_was_written(db_url, tmp_path):
    _filled(db_url)
    seen = []
    started = time.perf_counter()
    summary = export(db_url, tmp_path, page_size=1, progress=seen.append)
    wall = time.perf_counter() - started
    call_rows = pq.read_table(tmp_path / "calls").to_pylist()
    trajectories = pq.read_table(tmp_path / "trajectories").to_pylist()
    assert (summary.episodes, summary.calls, summary.call_rows, summary.trajectories) == (
        2, 4, 5, 3)
    assert summary.calls == len({r["call_id"] for r in call_rows})
    assert summary.call_rows == len(call_rows) and summary.trajectories == len(trajectories)
    assert summary.call_ids == sum(len(r["prompt_ids"]) + len(r["completion_ids"])
                                   for r in call_rows)
    assert summary.trajectory_ids == sum(len(r["prompt_ids"]) + len(r["response_ids"])
                                         for r in trajectories)
    assert summary.trained_tokens == sum(sum(r["response_mask"]) for r in trajectories)
    assert 0 < summary.trained_tokens < sum(len(r["response_ids"]) for r in trajectories)
    assert summary.tokens == summary.call_ids + summary.trajectory_ids
    assert summary.out == str(tmp_path) and 0 < summary.seconds <= wall
    assert all(r["request"] and r["response"] for r in call_rows)  # bodies were read
    assert [(p.episodes, p.episodes_total) for p in seen] == [(0, 2), (1, 2), (2, 2)]
    last = seen[-1]
    assert (last.calls, last.trajectories, last.tokens) == (
        summary.calls, summary.trajectories, summary.tokens)
    assert all(0 <= p.seconds <= wall for p in seen)
    [run] = manifest(tmp_path)["runs"]
    assert run["episodes"] == 2 and run["calls"] == 4 and run["tokens"] == summary.tokens
    assert 0 < run["seconds"] <= wall and run["files"] == summary.files


def test_a_whole_table_export_adds_the_calls_outside_any_episode(db_url, tmp_path):
    _filled(db_url)
    summary = export(db_url, tmp_path / "all", finished_only=False)
    rows = pq.read_table(tmp_path / "all" / "calls").to_pylist()
    assert sorted({r["episode_id"] or "-" for r in rows}) == ["-", "e1", "e2", "open"]
    assert summary.calls == 6 and summary.episodes == 3
    assert manifest(tmp_path / "all")["watermark"] is None  # no watermark without finishing
    for name, narrowed in (("ids", {"episodes": ["e1"]}), ("group", {"group": "g"})):
        out = tmp_path / name
        export(db_url, out, finished_only=False, **narrowed)
        assert all(r["episode_id"] for r in pq.read_table(out / "calls").to_pylist())
    only = export(db_url, tmp_path / "traj", finished_only=False, datasets="trajectories")
    assert only.calls == 0 and not (tmp_path / "traj" / "calls").exists()


def test_the_selection_picks_episodes_and_is_recorded(db_url, tmp_path):
    _filled(db_url)
    now = float(int(time.time()))  # whole seconds: exact as a datetime too

    def chosen(name: str, **selection) -> list[str]:
        export(db_url, tmp_path / name, datasets=["trajectories"], **selection)
        return sorted({r["episode_id"] for r in pq.read_table(
            tmp_path / name / "trajectories").to_pylist()})

    assert chosen("since", since=now + 60) == []
    assert chosen("until", until=now - 3600) == []
    assert chosen("window", since=datetime.fromtimestamp(now - 3600, timezone.utc),
                  until=now + 60) == ["e1", "e2"]
    assert chosen("ids", episodes=["e2", "e2", "nope"]) == ["e2"]
    assert chosen("group", group="nobody") == []
    selection = manifest(tmp_path / "window")["selection"]
    assert (selection["since"], selection["until"]) == (now - 3600, now + 60)
    assert selection["datasets"] == ["trajectories"] and selection["finished_only"] is True
    assert manifest(tmp_path / "ids")["selection"]["episode_ids"] == ["e2", "nope"]


def test_an_existing_export_is_extended_or_replaced_only_when_asked(db_url, tmp_path):
    _filled(db_url)
    first = export(db_url, tmp_path)
    with pytest.raises(ExportError) as refused:
        export(db_url, tmp_path)
    assert str(refused.value) == (
        "the output directory already holds an export; add --incremental to append what "
        "is new, or --overwrite to replace it")
    with pytest.raises(ExportError) as different:
        export(db_url, tmp_path, incremental=True, group="g", datasets=["calls"])
    assert str(different.value) == (
        "--incremental must select what the existing export did (group_id: None then, 'g' "
        "now, datasets: ('calls', 'trajectories') then, ('calls',) now)")

    again = export(db_url, tmp_path, incremental=True)  # nothing new: no new files
    assert again.files == [] and manifest(tmp_path)["obsolete"] == []
    replaced = export(db_url, tmp_path, overwrite=True)
    on_disk = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.parquet"))
    assert on_disk == sorted(replaced.files) and not set(first.files) & set(replaced.files)
    assert len(manifest(tmp_path)["runs"]) == 1


def test_an_empty_run_still_gives_each_dataset_a_file_once(db_url, tmp_path):
    first = export(db_url, tmp_path, incremental=True)
    assert sorted(f.split("/")[0] for f in first.files) == ["calls", "trajectories"]
    assert export(db_url, tmp_path, incremental=True).files == []


def test_bad_arguments_and_a_failed_write_are_clear_errors(db_url, tmp_path):
    with pytest.raises(ExportError) as bad:
        export(db_url, tmp_path / "a", datasets=["calls", "bogus"])
    assert str(bad.value) == "datasets must be among calls, trajectories; got ['bogus', 'calls']"
    with pytest.raises(ExportError, match=r"got \[\]$"):
        export(db_url, tmp_path / "b", datasets=[])
    with pytest.raises(ExportError, match=r"^no database at "):
        export(f"sqlite:///{tmp_path / 'missing.db'}", tmp_path / "c")

    _filled(db_url)
    out = tmp_path / "d"
    out.mkdir()
    (out / "trajectories").write_text("in the way")
    with pytest.raises(ExportError) as failed:
        export(db_url, out)
    assert str(failed.value).startswith(f"cannot write to {out}: ")
    assert list((out / "calls").iterdir()) == []  # not even a hidden temp file


def test_a_manifest_without_recent_finishes_keeps_its_watermark(db_url, tmp_path):
    """A manifest whose overlap set is missing (written before it existed, or edited)
    still never moves its watermark back."""
    out = tmp_path / "out"
    _db(db_url, calls("a"), finish("a", 1.0))
    export(db_url, out, incremental=True)
    t = finished_at(db_url, "a")
    edited = manifest(out)
    edited["watermark"], edited["recent"] = t + 30, {}
    (out / "_manifest.json").write_text(json.dumps(edited))
    assert export(db_url, out, incremental=True).episodes == 0
    assert manifest(out)["watermark"] == t + 30
    assert export(db_url, out, incremental=True).episodes == 0


def intent(episode: str, call_id: str):
    """A call a replica admitted and answered whose row is not stored (storage.intents)."""
    async def step(engine):
        async with engine.begin() as conn:
            await conn.execute(text(
                "INSERT INTO call_intents (call_id, episode_id, replica, incarnation, "
                "admitted_at) VALUES (:c, :e, 'replica-a', 'i1', :t)"),
                {"c": call_id, "e": episode, "t": time.time()})
    return step


def stored(episode: str, call_id: str):
    """That call's record, replayed from the replica's journal."""
    async def step(engine):
        await insert_calls(engine, [CallRecord(
            call_id=call_id, episode_id=episode, seq=5, endpoint="chat.completions",
            t_start=time.time(), http_status=200, prompt_ids=[1, 2, 3],
            choices=[ChoiceRecord(index=0, finish_reason="stop", completion_ids=[4],
                                  token_source="engine")])])
    return step


def test_an_episode_waiting_for_a_journal_is_exported_by_a_later_run(db_url, tmp_path):
    """An episode with a call still in a replica's journal is left out, and the watermark
    stays below it however much later the next episode finished; once the call is stored,
    the next run exports the episode whole, and nothing else twice."""
    out, late_call = tmp_path / "out", uuid7()
    _db(db_url, calls("held"), finish("held", 1.0), intent("held", late_call),
        calls("later"))
    t = finished_at(db_url, "held")
    _db(db_url, finish("later", 0.5, at=t + 3 * SETTLE))
    first = export(db_url, out, incremental=True)
    assert (first.episodes, first.held) == (1, 1) and episodes_of(out, 0) == [("later", 0.5)]
    assert manifest(out)["watermark"] <= t
    assert export(db_url, out, incremental=True).episodes == 0  # still waiting
    _db(db_url, stored("held", late_call))
    third = export(db_url, out, incremental=True)
    assert (third.episodes, third.held) == (1, 0) and set(episodes_of(out, 2)) == {("held", 1.0)}
    assert late_call in {r["call_id"] for r in run_rows(out, 2, "calls")}
    assert export(db_url, out, incremental=True).episodes == 0
