"""One slot (task x config x repeat) driven to its end: find what an earlier run left,
register the episode, run the harness at its base URL, grade it, finish it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import msgspec

from tracetap.analysis.runner import grade, outcomes, process
from tracetap.analysis.runner.admin import AdminClient, Finish, Harness, Registered, Registration
from tracetap.analysis.runner.plan import Slot
from tracetap.analysis.runner.template import TemplateError, argv

RAN, SKIPPED = "ran", "skipped"


class Commands(msgspec.Struct, frozen=True):
    """How every slot of the run is run."""

    harness: str  # the harness command template
    harness_name: str
    grader: str | None = None
    shell: bool = False
    timeout: float | None = None
    logs: Path | None = None  # each attempt's harness and grader output, EPISODE.log
    overlay: str | None = None  # every episode registered with it (docs/overlays.md)
    id_secret: str = ""  # keys the hash in each episode id (plan.Slot.episode_id)


class Result(msgspec.Struct, frozen=True):
    slot: Slot
    episode_id: str
    status: str  # RAN, or SKIPPED (finished by an earlier run)
    reward: float | None
    outcome: str | None
    interrupted: int = 0  # earlier attempts, interrupted, that this run ran again


async def run_slot(slot: Slot, admin: AdminClient, commands: Commands) -> Result:
    attempt, interrupted = 0, 0
    while True:
        found = await admin.episode(slot.episode_id(attempt, commands.id_secret))
        if found is None:
            registered = await admin.register(_registration(slot, commands, attempt))
            if registered is not None:
                break
            continue  # taken meanwhile: read it again (unfinished: it is passed over)
        if found.finished_at is not None and found.outcome != outcomes.INTERRUPTED:
            return Result(slot, found.id, SKIPPED, found.reward, found.outcome)
        if found.finished_at is None:  # registered by a run that died before finishing it
            await admin.finish(found.id, _interrupted(slot, attempt, "left unfinished"))
        interrupted += 1  # finished as interrupted now, or by a run stopped with Ctrl-C
        attempt += 1
    episode_id = registered.id
    try:
        finish = await _attempt(slot, registered, commands)
    except BaseException:  # Ctrl-C, or a harness that could not start: not its reward
        await asyncio.shield(
            _finish_quietly(admin, episode_id, _interrupted(slot, attempt, "run stopped"))
        )
        raise
    await admin.finish(episode_id, finish)
    return Result(slot, episode_id, RAN, finish.reward, finish.outcome, interrupted)


async def _attempt(slot: Slot, registered: Registered, commands: Commands) -> Finish:
    values = _values(slot, registered)
    env = _env(slot, registered)
    log = commands.logs / f"{registered.id}.log" if commands.logs else None
    harness = argv(commands.harness, values, shell=commands.shell, what="--harness")
    exited = await process.run(harness, env=env, timeout=commands.timeout, log=log)
    return _with_output(await _graded(exited, values, env, commands, log), exited)


def _with_output(finish: Finish, exited: process.Exited) -> Finish:
    """A harness that failed or timed out: the end of what it printed to stderr (why it
    failed, in its own words) is in ``info.harness_stderr``, and so in its packet."""
    if (exited.code == 0 and not exited.timed_out) or not exited.stderr_tail:
        return finish
    info = finish.info if isinstance(finish.info, dict) else {}
    return msgspec.structs.replace(finish, info={**info, "harness_stderr": exited.stderr_tail})


async def _graded(exited: process.Exited, values: dict[str, Any],
                  env: dict[str, str], commands: Commands, log: Path | None) -> Finish:
    if exited.timed_out:
        return Finish(reward=0.0, outcome=outcomes.TIMEOUT, info={"timeout_s": commands.timeout})
    if commands.grader is None:
        return grade.from_exit(exited.code)
    values["exit_code"] = exited.code
    env["TRACETAP_EXIT_CODE"] = str(exited.code)
    grader = argv(commands.grader, values, shell=commands.shell, what="--grader")
    graded = await process.run(grader, env=env, timeout=commands.timeout, log=log, capture=True)
    if graded.timed_out or graded.code != 0:
        why = "timed out" if graded.timed_out else f"exited {graded.code}"
        return Finish(outcome=outcomes.GRADER_ERROR, info={"grader": why})
    try:
        return grade.from_output(graded.stdout)
    except grade.GraderError as exc:
        return Finish(outcome=outcomes.GRADER_ERROR, info={"grader": str(exc)})


def _registration(slot: Slot, commands: Commands, attempt: int) -> Registration:
    return Registration(
        id=slot.episode_id(attempt, commands.id_secret),
        group_id=slot.group,
        task_id=slot.task.id,
        harness=Harness(commands.harness_name, slot.config),
        metadata={"run": slot.run_id, "repeat": slot.repeat, "attempt": attempt},
        overlay=commands.overlay,
    )


def _values(slot: Slot, registered: Registered) -> dict[str, Any]:
    """What ``{...}`` in a template can name."""
    return {
        "base_url": registered.base_url,
        "api_key": registered.api_key,
        "episode": registered.id,
        "group": slot.group,
        "task_id": slot.task.id,
        "task": slot.task.fields,
        "config": slot.config,
        "repeat": slot.repeat,
        "run_id": slot.run_id,
    }


def _env(slot: Slot, registered: Registered) -> dict[str, str]:
    # Anthropic's SDK appends /v1 itself; the episode's key rides in the path either way.
    root = registered.base_url.removesuffix("/v1")
    # The harness is untrusted: none of the runner's TRACETAP_* settings (the admin token
    # among them) reach it.
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("TRACETAP_")}
    return {
        **inherited,
        "OPENAI_BASE_URL": registered.base_url,
        "OPENAI_API_KEY": registered.api_key,
        "ANTHROPIC_BASE_URL": root,
        "ANTHROPIC_API_KEY": registered.api_key,
        "TRACETAP_EPISODE": registered.id,
        "TRACETAP_TASK_ID": slot.task.id,
        "TRACETAP_RUN_ID": slot.run_id,
    }


def _interrupted(slot: Slot, attempt: int, why: str) -> Finish:
    return Finish(
        outcome=outcomes.INTERRUPTED, info={"run": slot.run_id, "attempt": attempt, "why": why}
    )


async def _finish_quietly(admin: AdminClient, episode_id: str, finish: Finish) -> None:
    """Best effort on the way out: a rerun finishes it anyway if this does not."""
    try:
        await asyncio.wait_for(admin.finish(episode_id, finish), 5.0)
    except Exception:  # the proxy may be gone too; the rerun will see it
        pass


def check_templates(slots: list[Slot], commands: Commands) -> None:
    """Fill every slot's commands before anything runs, so a field a task lacks is an
    error now, not an episode failed halfway through the batch."""
    for slot in slots:
        values = _values(slot, Registered(slot.episode_id(0), "http://proxy/v1", "key"))
        try:
            argv(commands.harness, values, shell=commands.shell, what="--harness")
            if commands.grader is not None:
                argv(
                    commands.grader,
                    {**values, "exit_code": 0},
                    shell=commands.shell,
                    what="--grader",
                )
        except TemplateError as exc:
            raise TemplateError(f"task {slot.task.id!r}: {exc}") from None
