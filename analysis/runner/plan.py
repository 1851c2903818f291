"""The run's inputs (tasks, harness configs, repeats) expanded into slots, each with an
episode id that the same inputs always give, so a rerun finds what an earlier one did."""

from __future__ import annotations

import hashlib
import hmac
import re
from pathlib import Path
from typing import Any

import msgspec

from tracetap.analysis.runner.template import TemplateError, fill

_ID_CHARS = re.compile(r"[^A-Za-z0-9._:-]")
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,40}")


class Task(msgspec.Struct, frozen=True):
    id: str
    fields: dict[str, Any]  # the task's JSON line, read by {task.NAME}


class Slot(msgspec.Struct, frozen=True):
    """One task x config x repeat: one episode (several attempts when interrupted)."""

    run_id: str
    task: Task
    config_index: int
    config: dict[str, Any]
    repeat: int
    group: str

    def episode_id(self, attempt: int, secret: str = "") -> str:
        """The attempt's id: the same inputs, the same id, so a rerun finds it. With a
        ``secret`` (the runner's: ``tracetap run`` uses its admin token), a keyed hash
        of the rest follows the run id: no agent can guess an id before it is registered
        and send calls to it first."""
        config = f"c{self.config_index}-{digest(self.config, 6)}"
        rest = f"{safe(self.task.id, 48)}.{config}.r{self.repeat}.a{attempt}"
        if not secret:
            return f"{self.run_id}.{rest}"
        tag = hmac.new(secret.encode(), f"{self.run_id}.{rest}".encode(), "sha256").hexdigest()
        return f"{self.run_id}.{tag[:16]}.{rest}"


def digest(value: Any, n: int = 8) -> str:
    """A short hash of a JSON value (keys sorted: the same value, the same hash)."""
    return hashlib.sha256(msgspec.json.encode(value, order="sorted")).hexdigest()[:n]


def safe(text: str, limit: int) -> str:
    """``text`` as an id part (A-Z a-z 0-9 . _ : -); changed or long text gets a hash of
    the original, so two different texts never share an id."""
    cleaned = _ID_CHARS.sub("_", text)
    if cleaned == text and len(text) <= limit:
        return text
    return f"{cleaned[: limit - 9]}-{digest(text)}"


def read_tasks(path: str | Path) -> list[Task]:
    """A JSONL file of objects, each with an ``id`` (or ``task_id``); ids unique."""
    tasks: list[Task] = []
    seen: set[str] = set()
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            fields = msgspec.json.decode(line)
        except msgspec.DecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"{path}:{n}: a task is a JSON object")
        task_id = fields.get("id", fields.get("task_id"))
        if not isinstance(task_id, (str, int)) or isinstance(task_id, bool):
            raise ValueError(f'{path}:{n}: a task needs an "id" (a string or an integer)')
        task_id = str(task_id)
        if task_id in seen:
            raise ValueError(f"{path}:{n}: task id {task_id!r} is listed twice")
        seen.add(task_id)
        tasks.append(Task(task_id, {**fields, "id": task_id}))
    if not tasks:
        raise ValueError(f"{path}: no tasks")
    return tasks


def read_configs(path: str | Path | None, given: list[str]) -> list[dict[str, Any]]:
    """Harness configs: a JSONL file of flat ``{factor: level}`` objects and/or
    ``--config k=v,k=v`` terms (values read as JSON when they are, else as text); one
    empty config when there are none."""
    configs: list[dict[str, Any]] = []
    if path:
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if line.strip():
                value = msgspec.json.decode(line)
                if not isinstance(value, dict):
                    raise ValueError(f"{path}:{n}: a config is a JSON object")
                configs.append(value)
    configs.extend(parse_config(term) for term in given)
    return configs or [{}]


def parse_config(term: str) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in term.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--config {term!r}: each term is KEY=VALUE")
        try:
            config[key.strip()] = msgspec.json.decode(value.strip())
        except msgspec.DecodeError:
            config[key.strip()] = value.strip()
    return config


def read_patch(value: str) -> tuple[str, str]:
    """``--overlay-file [NAME=]FILE``: (the patch's name, its source)."""
    name, sep, path = value.rpartition("=") if "=" in value else ("", "", value)
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--overlay-file {path}: {exc}") from None
    if not sep:
        stem = safe(Path(path).stem, 40).replace(":", "_")
        name = f"{stem}-{hashlib.sha256(source.encode()).hexdigest()[:8]}"
    return name, source


def default_run_id(*parts: Any) -> str:
    """The run id when none is given: a hash of everything that decides what runs, so
    the same command line resumes its own run."""
    return "run-" + digest(list(parts), 10)


def check_run_id(run_id: str) -> str:
    if not _RUN_ID.fullmatch(run_id):
        raise ValueError(f"--run-id {run_id!r}: use 1-40 characters of A-Z a-z 0-9 _ -")
    return run_id


def slots(
    run_id: str, tasks: list[Task], configs: list[dict[str, Any]], repeats: int, group: str
) -> list[Slot]:
    """Every task x config x repeat, in that order (a task's repeats run side by side)."""
    if repeats < 1:
        raise ValueError("--repeats must be at least 1")
    out = []
    for task in tasks:
        for index, config in enumerate(configs):
            values = {"run_id": run_id, "task_id": task.id, "task": task.fields, "config": config}
            group_id = safe(fill(group, values, "--group"), 128)
            for repeat in range(repeats):
                out.append(Slot(run_id, task, index, config, repeat, group_id))
    return out


__all__ = [
    "Slot",
    "Task",
    "TemplateError",
    "check_run_id",
    "default_run_id",
    "read_configs",
    "read_patch",
    "read_tasks",
    "slots",
]
