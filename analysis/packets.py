"""Failure packets: each failed episode compiled into what a harness-editing model reads.

Deterministic: the same database and options give byte-identical files (keys sorted,
packets ordered by batch, task and episode id, no time of the run inside). The packet's
shape is ``analysis/packet.schema.json``; docs/harness-engineering.md explains it.

Why an episode failed (``failure``): ``unsuccessful`` (not a success, analysis.select),
``call_error`` (one of its calls failed: an upstream error, a cut stream, a 4xx/5xx
reply; an attempt an overlay vetoed is not one, the model answered and was asked again),
``context_length`` (a failed call whose error or reply says the context was too
long). ``--failure`` chooses which of them select an episode.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec

from tracetap.analysis import conversation
from tracetap.analysis.episodes import AnalysisError, Episode, open_reader, read, run
from tracetap.analysis.integrity import clean
from tracetap.analysis.packet_overlay import Overlay, events_by_action, overlay_of
from tracetap.analysis.select import Selector, Success, value_of
from tracetap.analysis.steps import CallBodies, read_steps
from tracetap.storage.scan import EpisodeFilter, ScannedCall
from tracetap.storage.summaries import CallSummary, call_overlays, call_summaries

PACKET_VERSION = "3"
FAILURES = ("unsuccessful", "call_error", "context_length")
SCHEMA_FILE = Path(__file__).with_name("packet.schema.json")
VIEWER = "/tracetap/ui"
_CONTEXT = re.compile(
    r"context[ _-]?(length|window)|maximum context|too many tokens|"
    r"prompt is too long",
    re.IGNORECASE,
)


class Options(msgspec.Struct, kw_only=True, frozen=True):
    success: Success = Success()
    failures: tuple[str, ...] = FAILURES
    steps: int = 5  # the last K action-observation steps
    max_chars: int = 2000  # per text: system prompt, message, arguments, observation, error
    batch: str | None = None  # a selector key grouping packets into task batches
    where: Selector | None = None
    per_batch: int | None = None  # at most this many packets per batch (the first by task)


# A packet as packet.schema.json describes it; written with sorted keys (fields included).
class Harness(msgspec.Struct, kw_only=True, gc=False):
    name: str | None
    config: dict[str, Any]


class CallError(msgspec.Struct, kw_only=True, gc=False):
    call_id: str
    status: str
    http_status: int
    error: str | None


class Outcome(msgspec.Struct, kw_only=True, gc=False):
    success: bool
    failure: list[str]
    reward: float | None
    rewards: Any
    outcome: str | None
    info: Any
    harness_output: str | None  # the end of the failed harness's stderr (tracetap run's)
    call_errors: list[CallError]


class Packet(msgspec.Struct, kw_only=True, gc=False):
    packet_version: str
    episode_id: str
    group_id: str | None
    task_id: str | None
    batch: str | None
    harness: Harness
    overlay: Overlay | None
    task: conversation.Task
    steps: list[conversation.Step]
    steps_total: int
    outcome: Outcome
    calls: list[str]
    source_call_id: str | None
    viewer: str


class PacketSet(msgspec.Struct, kw_only=True):
    episodes: int  # selected
    reasons: dict[str, int]  # packets per failure reason
    packets: list[Packet]
    batches: list[dict[str, Any]] | None = None
    infra: int = 0  # failed episodes given no packet: their integrity is infra
    failed: int = 0  # failed episodes with a packet before --per-batch left some out


def build(db: str, filt: EpisodeFilter, options: Options) -> PacketSet:
    unknown = set(options.failures) - set(FAILURES)
    if unknown or not options.failures:
        raise AnalysisError(f"--failure must be among {', '.join(FAILURES)}")
    if options.steps < 1 or options.max_chars < 1:
        raise AnalysisError("--steps and --max-chars must be at least 1")
    if options.per_batch is not None and options.per_batch < 1:
        raise AnalysisError("--per-batch must be at least 1")
    return run(_build(db, filt, options))


async def _build(db: str, filt: EpisodeFilter, options: Options) -> PacketSet:
    async with open_reader(db) as reader:
        episodes = await _selected(reader, filt, options.where)
        found = await _failed(reader, episodes, options)
    packets = [_packet(e, reasons, found, options) for e, reasons in found.chosen]
    packets.sort(key=lambda p: (p.batch or "", p.task_id or "", p.episode_id))
    failed = len(packets)
    if options.per_batch is not None:
        packets = _capped(packets, options.per_batch)
    counts = {r: sum(r in p.outcome.failure for p in packets) for r in options.failures}
    batches = _batches(episodes, packets, options) if options.batch else None
    return PacketSet(episodes=len(episodes), reasons=counts, packets=packets, batches=batches,
                     infra=found.infra, failed=failed)


def _capped(packets: list[Packet], limit: int) -> list[Packet]:
    """The first ``limit`` packets of each batch (of all, without --batch), in the packets'
    order: a sparse set of failures, as an engineer model is given a few at a time."""
    kept: dict[str | None, int] = defaultdict(int)
    out = []
    for p in packets:
        if kept[p.batch] < limit:
            kept[p.batch] += 1
            out.append(p)
    return out


async def _selected(reader, filt: EpisodeFilter, where: Selector | None) -> list[Episode]:
    """The episodes the filters and --where select; an error when none is."""
    episodes = await read(reader, filt, policies=bool(where and where.needs_policies))
    if where is not None:
        episodes = [e for e in episodes if where.matches(e)]
    if not episodes:
        raise AnalysisError(
            "the selection matches no episode" + (f" (--where {where.text!r})" if where else "")
        )
    return episodes


class _Failed(msgspec.Struct):
    chosen: list[tuple[Episode, list[str]]]  # failed episodes, with why
    calls: dict[str, list[CallSummary]]  # a suspect episode's calls, in order
    bodies: dict[str, ScannedCall]  # every call of a failed episode: its steps span them
    overlays: dict[str, str]  # calls.overlay of those calls that have one
    infra: int  # failed episodes given no packet: their integrity is infra


async def _failed(reader, episodes: list[Episode], options: Options) -> _Failed:
    """The failed episodes among ``episodes``, with what their packets are built from."""
    # failed_calls counts vetoed attempts too (storage.tables.FAILED_SQL): _reasons tells.
    suspects = [e for e in episodes if not options.success(e) or e.summary.failed_calls]
    suspects, infra = clean(suspects)  # an infra failure is not the harness's
    calls = await call_summaries(reader, [e.id for e in suspects])
    by_episode: dict[str, list[CallSummary]] = defaultdict(list)
    for call in calls:
        by_episode[call.episode_id].append(call)
    failed_ids = [c.call_id for c in calls if _errored(c)]
    failed_bodies = (
        await reader.bodies(failed_ids) if ("context_length" in options.failures) else {}
    )
    chosen: list[tuple[Episode, list[str]]] = []
    for e in suspects:
        reasons = _reasons(e, by_episode[e.id], failed_bodies, options)
        if reasons:
            chosen.append((e, reasons))
    wanted = sorted(c.call_id for e, _ in chosen for c in by_episode[e.id])
    bodies = await reader.bodies(wanted)
    overlays = await call_overlays(reader, wanted)
    return _Failed(chosen=chosen, calls=by_episode, bodies=bodies, overlays=overlays,
                   infra=infra)


def _reasons(
    e: Episode, calls: list[CallSummary], bodies: dict[str, ScannedCall], options: Options
) -> list[str]:
    reasons = []
    if "unsuccessful" in options.failures and not options.success(e):
        reasons.append("unsuccessful")
    failed = [c for c in calls if _errored(c)]
    if "call_error" in options.failures and failed:
        reasons.append("call_error")
    if "context_length" in options.failures and any(
        _CONTEXT.search(c.error or "")
        or _CONTEXT.search((bodies[c.call_id].response or "") if c.call_id in bodies else "")
        for c in failed
    ):
        reasons.append("context_length")
    return reasons


def _errored(call: CallSummary) -> bool:
    """A call that failed; an overlay's vetoed attempt did not (docs/overlays.md)."""
    return call.failed and call.status != "vetoed"


def _packet(e: Episode, reasons: list[str], found: _Failed, options: Options) -> Packet:
    s, budget = e.summary, options.max_chars
    calls = found.calls[e.id]
    read = []
    for c in calls:
        body = found.bodies.get(c.call_id)
        read.append(CallBodies(
            call_id=c.call_id, status=c.status, failed=c.failed,
            request=body.request if body else None,
            upstream_request=body.upstream_request if body else None,
            response=body.response if body else None,
        ))
    task, steps, before = read_steps(read, budget)
    overlay = overlay_of(e, calls, found.overlays, before, budget)
    if overlay is not None:
        own = events_by_action(calls, found.overlays, overlay.events)
        for step in steps:
            step.overlay_events = own.get(step.call_id, [])
    return Packet(
        packet_version=PACKET_VERSION,
        episode_id=s.id,
        group_id=s.group_id,
        task_id=s.task_id,
        batch=value_of(e, options.batch) if options.batch else None,
        harness=Harness(name=s.harness_name, config=e.config),
        overlay=overlay,
        task=task,
        steps=steps[-options.steps :],
        steps_total=len(steps),
        outcome=Outcome(
            success=options.success(e),
            failure=reasons,
            reward=s.reward,
            rewards=_json(s.rewards),
            outcome=s.outcome,
            info=(info := _json(s.info)),
            harness_output=conversation.cut(
                info.get("harness_stderr") if isinstance(info, dict) else None, budget
            ),
            call_errors=[
                CallError(
                    call_id=c.call_id,
                    status=c.status,
                    http_status=c.http_status,
                    error=conversation.cut(c.error, budget),
                )
                for c in calls
                if _errored(c)
            ],
        ),
        calls=[c.call_id for c in calls],
        source_call_id=calls[-1].call_id if calls else None,
        viewer=f"{VIEWER}/episodes/{s.id}",
    )


def _json(text: str | None) -> Any:
    return None if text is None else msgspec.json.decode(text)


def _batches(
    episodes: list[Episode], packets: list[Packet], options: Options
) -> list[dict[str, Any]]:
    """Per batch: its tasks (failed or not), its episodes, successes and packets."""
    members: dict[str, list[Episode]] = defaultdict(list)
    for e in episodes:
        members[value_of(e, options.batch) or ""].append(e)
    packed: dict[str, list[str]] = defaultdict(list)
    for p in packets:
        packed[p.batch or ""].append(p.episode_id)
    return [
        {
            "batch": name or None,
            "tasks": sorted({e.task for e in es if e.task}),
            "episodes": len(es),
            "successes": sum(options.success(e) for e in es),
            "packets": packed.get(name, []),
        }
        for name, es in sorted(members.items())
    ]


_ENCODER = msgspec.json.Encoder(order="sorted")


def write(out: str | os.PathLike, result: PacketSet) -> list[Path]:
    """packets.jsonl, packets.parquet (and batches.jsonl) in ``out``, each replaced whole."""
    import pyarrow as pa  # only here: the CLI imports this module's neighbours cheaply
    import pyarrow.parquet as pq

    root = Path(out)
    try:
        root.mkdir(parents=True, exist_ok=True)
        packets = result.packets
        lines = _ENCODER.encode_lines(packets)  # JSON escapes newlines: one packet a line
        files = [_replace(root / "packets.jsonl", lambda f: f.write_bytes(lines))]
        table = pa.table(
            {
                "episode_id": pa.array([p.episode_id for p in packets], pa.string()),
                "batch": pa.array([p.batch for p in packets], pa.string()),
                "task_id": pa.array([p.task_id for p in packets], pa.string()),
                "harness": pa.array([p.harness.name for p in packets], pa.string()),
                "failure": pa.array([p.outcome.failure for p in packets], pa.list_(pa.string())),
                "reward": pa.array([p.outcome.reward for p in packets], pa.float64()),
                "packet": pa.array(lines.split(b"\n")[: len(packets)], pa.binary()).cast(
                    pa.string()
                ),
            }
        )
        files.append(_replace(root / "packets.parquet", lambda f: pq.write_table(table, f)))
        if result.batches is not None:
            text = _ENCODER.encode_lines(result.batches)
            files.append(_replace(root / "batches.jsonl", lambda f: f.write_bytes(text)))
    except OSError as exc:
        raise AnalysisError(f"cannot write packets to {root}: {exc.strerror or exc}") from exc
    return files


def _replace(path: Path, writer) -> Path:
    temp = path.with_name(f".{path.name}.tmp")
    try:
        writer(temp)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)
    return path
