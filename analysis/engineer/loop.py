"""The Harness-R1 loop over one task batch B, driven through running proxies:

1. run B without a patch (the baseline; ``tracetap run``'s runner, resumable);
2. compile its failed episodes into failure packets (``analysis.packets``);
3. per packet (or per batch of packets), ask the engineer for K candidate patches, each
   an episode of its own, group = the packet;
4. validate each: it is a patch, it loads in the sandbox (the proxy's install), every
   hook runs on the packet's recorded calls within its budget (the proxy replays them:
   ``POST /tracetap/overlays/NAME/replay``), and it breaks
   none of a small guard set of tasks the baseline solved;
5. run B with each valid patch and measure Δ_B against the baseline (``analysis.compare``):
   on the whole batch (in-batch) and on the tasks not in the group's packets (held out);
6. finish each candidate's engineer episode with its reward, the held-out Δ_B where the
   batch has held-out tasks (else the in-batch one; ``reward`` chooses), an invalid patch
   the stated penalty; with its group's advantage as the trainer computes it (invalid
   candidates in the group with their penalty), so ``tracetap export`` yields GRPO groups;
7. delete each candidate's patch once it is judged (its worker ends with it).

A proxy that runs no patch now (no sandbox, or its cap of workers reached) stops the loop
with its message: that is the operator's to fix, never a candidate's penalty.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
from typing import Any, TextIO

import msgspec

from tracetap.analysis import packets as packets_module
from tracetap.analysis.compare import compare
from tracetap.analysis.engineer import prompt, resume
from tracetap.analysis.engineer.ask import Asked, ask
from tracetap.analysis.episodes import AnalysisError, load
from tracetap.analysis.runner import plan
from tracetap.analysis.runner.admin import AdminClient, AdminError, Finish, PatchesUnavailable
from tracetap.analysis.runner.batch import run_batch
from tracetap.analysis.runner.episode import Commands, Result
from tracetap.analysis.select import Success, parse_selector
from tracetap.analysis.stats import normalised
from tracetap.storage.conversation import Readers
from tracetap.storage.scan import EpisodeFilter

SETTLE_SECONDS = 0.5


class Options(msgspec.Struct, kw_only=True, frozen=True):
    run_id: str
    model: str
    candidates: int = 4  # K per packet
    penalty: float = -1.0  # the reward of an invalid patch
    reward: str | None = None  # "in-batch" | "held-out"; None: held-out where the batch allows
    guard: int = 2  # tasks the baseline solved that a patch must not break
    hook_budget: float = 2.0  # seconds per hook on the recorded calls
    max_tokens: int = 4096  # of each engineer call (a small engine's context may not hold it)
    batch_packets: bool = False  # one request for all packets (else one per packet)
    max_packets: int | None = None  # the first packets only (the sparse setting)
    concurrency: int = 4
    repeats: int = 1  # episodes per task in every batch
    scripted: tuple[str, ...] = ()  # mock engine only: candidate k answers scripted[k]


class Row(msgspec.Struct, kw_only=True):
    """One candidate: what the table prints and the engineer episode's reward."""

    episode_id: str
    group: str
    candidate: int
    patch: str | None  # the installed patch's name
    sha256: str | None
    valid: bool
    why: str | None  # why it is invalid
    delta: float | None = None  # in-batch Δ_B
    interval: tuple[float, float] | None = None
    held_out_tasks: int = 0  # tasks of B not in the packets it was written from
    held_out_delta: float | None = None  # Δ_B on them (None: there are none)
    held_out_interval: tuple[float, float] | None = None
    fixed: list[str] = []
    broken: list[str] = []
    reward: float = 0.0
    reward_from: str | None = None  # "in-batch" or "held-out" (valid candidates)
    advantage: float | None = None  # (reward - group mean) / population std, K >= 2


async def engineer(
    db: str,
    tasks: list[plan.Task],
    commands: Commands,
    options: Options,
    admin: AdminClient,
    engineer_admin: AdminClient,
    progress: TextIO | None = None,
    *,
    readers: Readers,
) -> list[Row]:
    """``readers``: each wire API's conversation reader, for the packets."""
    # sys.stderr as it is now, not as it was when this module was imported (a default
    # argument would keep that stream, closed since: seen under pytest's capture).
    progress = sys.stderr if progress is None else progress
    base_run = f"{options.run_id}-base"
    baseline = await _batch(tasks, commands, None, base_run, admin, options, progress)
    found = await asyncio.to_thread(
        packets_module.build,
        db,
        EpisodeFilter(),
        packets_module.Options(where=parse_selector(f"meta.run={base_run}")),
        readers,
    )
    chosen = distinct_first(found.packets, options.max_packets)
    print(
        f"tracetap engineer: baseline {base_run}: {len(baseline)} episodes, "
        f"{len(found.packets)} failure packets ({len(chosen)} used)",
        file=progress,
    )
    base_rates = _rates(baseline)
    solved = sorted(t for t, rate in base_rates.items() if rate == 1.0)  # every repeat
    guard = [t for t in tasks if t.id in solved[: options.guard]]
    groups = [chosen] if options.batch_packets and chosen else [[p] for p in chosen]
    if options.reward == "held-out":
        _check_held_out(tasks, groups)
    rows = []
    for group_packets in groups:
        group = _group_id(options.run_id, group_packets)
        asked = await _candidates(group, group_packets, options, engineer_admin)
        judged, finished = [], set()
        for one in asked:
            row = _row(one, options)
            if one.existed and await _resumed(db, row, one, engineer_admin):
                finished.add(row.episode_id)
                judged.append(row)
                continue
            try:
                await _judge(
                    db, row, one, group_packets, tasks, guard, commands, options, base_run,
                    admin, progress, base_rates,
                )
            finally:
                if row.patch is not None:
                    await admin.delete_overlay(row.patch)
            judged.append(row)
        if len(judged) >= 2:  # the group's advantages, invalid candidates included
            for row, advantage in zip(judged, normalised([r.reward for r in judged])):
                row.advantage = advantage
        for row in judged:
            if row.episode_id not in finished:
                await engineer_admin.finish(row.episode_id, _finish(row))
        rows += judged
    return rows


async def _candidates(
    group: str, packets: list[Any], options: Options, admin: AdminClient
) -> list[Asked]:
    messages = prompt.messages(packets)
    metadata = {"engineer": options.run_id, "packets": [p.episode_id for p in packets]}
    return await asyncio.gather(
        *(
            ask(
                admin,
                episode_id=f"{group}.c{k}",
                group=group,
                candidate=k,
                model=options.model,
                messages=messages,
                max_tokens=options.max_tokens,
                metadata={**metadata, "candidate": k},
                scripted=options.scripted[k] if k < len(options.scripted) else None,
            )
            for k in range(options.candidates)
        )
    )


def distinct_first(packets: list[Any], limit: int | None) -> list[Any]:
    """At most ``limit`` packets, one of each task first (in the builder's order), then
    the others: two packets of one task say less than two tasks' failures."""
    if limit is None:
        return list(packets)
    seen: set[str | None] = set()
    first, rest = [], []
    for p in packets:
        (rest if p.task_id in seen else first).append(p)
        seen.add(p.task_id)
    return (first + rest)[:limit]


async def _resumed(db: str, row: Row, asked: Asked, engineer_admin: AdminClient) -> bool:
    """An earlier run's candidate: True when it finished (``row`` is what it recorded);
    else False, with ``asked`` given the reply its episode recorded, to be judged now."""
    state = await engineer_admin.episode(asked.episode_id)
    fields = None if state is None else resume.judged(state.info, state.reward)
    if state is not None and state.finished_at is not None and fields is not None:
        for name, value in fields.items():
            setattr(row, name, value)
        return True
    asked.reply = await resume.recorded_reply(db, asked.episode_id)
    if asked.reply is None:
        asked.error = "its episode (an earlier run's) recorded no reply in --db"
    return False


def _row(asked: Asked, options: Options) -> Row:
    """A candidate before it is judged: invalid, with the penalty, until shown valid."""
    return Row(
        episode_id=asked.episode_id,
        group=asked.group,
        candidate=asked.candidate,
        patch=None,
        sha256=None,
        valid=False,
        why=None,
        reward=options.penalty,
    )


async def _judge(
    db,
    row: Row,
    asked: Asked,
    packets,
    tasks,
    guard,
    commands,
    options,
    base_run,
    admin,
    progress,
    base_rates: dict[str, float],
) -> Row:
    """Fill ``row`` in; ``row.patch`` is set once the patch may be installed."""
    source = prompt.patch_of(asked.reply)
    if source is None:
        row.why = asked.error or "the reply has no ```python block"
        return row
    row.sha256 = hashlib.sha256(source.encode()).hexdigest()
    row.patch = f"eng-{row.sha256[:12]}"
    try:
        await admin.install_overlay(row.patch, source)
    except PatchesUnavailable:
        raise  # the proxy's state, not the candidate's fault: the loop stops
    except AdminError as exc:
        row.why = str(exc).split(": ", 2)[-1]
        return row
    for packet in packets:
        why = await admin.replay_overlay(row.patch, packet.episode_id, options.hook_budget)
        if why is not None:
            row.why = f"on packet {packet.episode_id}: {why}"
            return row
    checked = await _batch(
        guard, commands, row.patch, f"{options.run_id}-g{row.sha256[:8]}", admin, options, progress
    )
    broke = sorted(t for t, rate in _rates(checked).items() if rate < base_rates[t])
    if broke:
        row.why = f"regresses on the guard set: {', '.join(broke)}"
        return row
    cand_run = f"{options.run_id}-p{row.sha256[:8]}"
    await _batch(tasks, commands, row.patch, cand_run, admin, options, progress)
    episodes = await asyncio.to_thread(load, db, EpisodeFilter(), costs=True)
    result = compare(
        episodes,
        parse_selector(f"meta.run={base_run}"),
        [parse_selector(f"meta.run={cand_run}")],
        success=Success(),
        seen_tasks=frozenset(p.task_id for p in packets if p.task_id is not None),
        reward=options.reward,
    )
    (candidate,) = result.candidates
    row.valid, row.delta, row.interval = True, candidate.delta, tuple(candidate.interval)
    held = candidate.held_out
    if held is not None:
        row.held_out_tasks, row.held_out_delta = held.tasks, held.delta
        row.held_out_interval = None if held.interval is None else tuple(held.interval)
    row.fixed, row.broken = candidate.flips.fixed, candidate.flips.broken
    row.reward_from = result.reward
    row.reward = candidate.reward if candidate.reward is not None else candidate.delta
    return row


async def _batch(
    tasks,
    commands: Commands,
    overlay: str | None,
    run_id: str,
    admin: AdminClient,
    options: Options,
    progress: TextIO,
) -> list[Result]:
    if not tasks:
        return []
    slots = plan.slots(run_id, tasks, [{}], options.repeats, "{run_id}.{task_id}")
    patched = msgspec.structs.replace(commands, overlay=overlay)
    results, _ = await run_batch(
        slots, admin, patched, concurrency=options.concurrency, progress_stream=progress
    )
    # The proxy commits records every ~50 ms after a call ends; packets and Δ_B read the
    # database, so the last calls of the batch are given time to land.
    await asyncio.sleep(SETTLE_SECONDS)
    return results


def _rates(results: list[Result]) -> dict[str, float]:
    """Per task, the share of its episodes that succeeded (reward 1)."""
    by_task: dict[str, list[float]] = {}
    for r in results:
        by_task.setdefault(r.slot.task.id, []).append(float((r.reward or 0.0) >= 1.0))
    return {task: sum(v) / len(v) for task, v in by_task.items()}


def _check_held_out(tasks: list[plan.Task], groups: list[list[Any]]) -> None:
    """--reward held-out needs, for every group, a task of B outside its packets."""
    for packets in groups:
        seen = {p.task_id for p in packets}
        if not {t.id for t in tasks} - seen:
            raise AnalysisError(
                "--reward held-out: every task of the batch is in the packets "
                f"({', '.join(sorted(s for s in seen if s))}); leave tasks out of the "
                "packets (--max-packets) or use --reward in-batch"
            )


def _group_id(run_id: str, packets: list[Any]) -> str:
    if len(packets) == 1:
        return plan.safe(f"{run_id}.{packets[0].episode_id}", 128)
    ids = "|".join(p.episode_id for p in packets)
    return f"{run_id}.batch-{hashlib.sha256(ids.encode()).hexdigest()[:10]}"


def _finish(row: Row) -> Finish:
    info: dict[str, Any] = {"patch": row.patch, "sha256": row.sha256, "valid": row.valid}
    if row.valid:
        info.update(
            delta=row.delta, interval=list(row.interval or ()), fixed=row.fixed, broken=row.broken,
            held_out_tasks=row.held_out_tasks, held_out_delta=row.held_out_delta,
            held_out_interval=list(row.held_out_interval or ()), reward_from=row.reward_from,
        )
    else:
        info["invalid"] = row.why
    info["advantage"] = row.advantage
    return Finish(reward=row.reward, outcome="valid" if row.valid else "invalid", info=info)
