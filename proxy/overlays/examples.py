"""The three shipped overlays (docs/overlays.md), one per kind of hook:

- ``constraint_reminder,path=tasks.json``: pre-decision. Each episode's task constraints,
  read from a JSON file ``{task_id: text}`` (``"*"``: any other task), go into the model's
  context once, after the system prompt.
- ``tool_args_validator``: pre-action. Tool-call arguments are checked against the
  tool's JSON schema (a common subset: type, required, properties, additionalProperties,
  enum, const, bounds, items); a call that does not fit is vetoed and the model is asked
  again with the validation error as feedback.
- ``recovery_hint[,pattern=REGEX][,hint=TEXT]``: post-feedback. A tool result matching an
  error pattern gets a recovery hint after it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tracetap.proxy.overlays.hooks import EpisodeInfo, Inject, ModelReply, Observation, Veto

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "boolean": (bool,),
    "integer": (int,),
    "number": (int, float),
    "null": (type(None),),
}


class ConstraintReminder:
    def __init__(self, constraints: dict[str, str]) -> None:
        self.constraints = constraints

    async def on_episode_start(self, episode: EpisodeInfo) -> dict[str, Any]:
        text = self.constraints.get(episode.task_id or "", self.constraints.get("*"))
        return {"text": text, "given": False}

    async def before_model(self, request, state: dict[str, Any]) -> Inject | None:
        if state is None or state["given"] or not state["text"]:
            return None
        state["given"] = True  # once: the addition stays in the model's context after
        return Inject(
            messages=[{"role": "system", "content": f"Constraints: {state['text']}"}],
            at="after_system",
            reason="task constraints",
        )


def constraint_reminder(path: str) -> ConstraintReminder:
    constraints = json.loads(Path(path).read_text())
    if not isinstance(constraints, dict) or not all(
        isinstance(v, str) for v in constraints.values()
    ):
        raise ValueError(f"{path}: expected a JSON object of task id → constraint text")
    return ConstraintReminder(constraints)


class ToolArgsValidator:
    after_model_sees = "tool_calls"  # text before the tool calls streams to the client live

    async def after_model(self, reply: ModelReply, state: Any) -> Veto | None:
        schemas = {}
        for tool in reply.tools or ():
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                schemas[function["name"]] = function.get("parameters") or {"type": "object"}
        for call in reply.tool_calls:
            if call.name not in schemas:
                problem = f"there is no tool named {call.name!r}"
            else:
                try:
                    problem = schema_error(json.loads(call.arguments), schemas[call.name])
                except (ValueError, RecursionError):
                    problem = "the arguments are not valid JSON"
                except Unchecked:
                    continue  # left as the model wrote it: as if there were no validator
            if problem is not None:
                return Veto(
                    feedback=f"Your call to {call.name} was rejected: {problem}. "
                    "Call the tool again with arguments that match its schema.",
                    reason=f"{call.name}: {problem}",
                )
        return None


def tool_args_validator() -> ToolArgsValidator:
    return ToolArgsValidator()


# The schema comes from the agent's request and the arguments from the model: both are the
# policy's. A check runs on the event loop every call shares, so its work is bounded: at
# most MAX_STEPS schema nodes visited (an enum's entries count each) and MAX_DEPTH levels;
# past either the call is left unchecked. Real tool schemas take tens of steps.
MAX_STEPS = 20_000
MAX_DEPTH = 64


class Unchecked(Exception):
    """The schema and arguments need more work than a check may take."""


class _Budget:
    def __init__(self, steps: int = MAX_STEPS):
        self.steps = steps

    def spend(self, steps: int = 1) -> None:
        self.steps -= steps
        if self.steps < 0:
            raise Unchecked


def schema_error(value: Any, schema: Any, where: str = "arguments",
                 budget: _Budget | None = None, depth: int = 0) -> str | None:
    """The first way ``value`` breaks ``schema`` (a common subset), or None; raises
    Unchecked past MAX_STEPS or MAX_DEPTH."""
    if not isinstance(schema, dict):
        return None
    budget = budget or _Budget()
    budget.spend()
    if depth > MAX_DEPTH:
        raise Unchecked
    for check in (_value_error, _type_error, _bounds_error, _items_error, _object_error):
        problem = check(value, schema, where, budget, depth + 1)
        if problem is not None:
            return problem
    return None


def _value_error(value: Any, schema: dict[str, Any], where: str, budget: _Budget,
                 depth: int) -> str | None:
    """const, enum, anyOf / oneOf."""
    if "const" in schema and value != schema["const"]:
        return f"{where} must be {schema['const']!r}"
    if "enum" in schema:
        if isinstance(schema["enum"], list):
            budget.spend(len(schema["enum"]))
        if value not in schema["enum"]:
            return f"{where} must be one of {schema['enum']!r}"
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and all(
            schema_error(value, option, where, budget, depth) for option in schema[key]
        ):
            return f"{where} matches none of its allowed shapes"
    return None


def _type_error(value: Any, schema: dict[str, Any], where: str, budget: _Budget,
                depth: int) -> str | None:
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds or []
    if kinds and not any(_is(value, k) for k in kinds):
        return f"{where} must be of type {' or '.join(kinds)}, got {json.dumps(value)}"
    return None


def _bounds_error(value: Any, schema: dict[str, Any], where: str, budget: _Budget,
                  depth: int) -> str | None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    if "minimum" in schema and value < schema["minimum"]:
        return f"{where} must be at least {schema['minimum']}"
    if "maximum" in schema and value > schema["maximum"]:
        return f"{where} must be at most {schema['maximum']}"
    return None


def _items_error(value: Any, schema: dict[str, Any], where: str, budget: _Budget,
                 depth: int) -> str | None:
    if not isinstance(value, list):
        return None
    if len(value) < schema.get("minItems", 0):
        return f"{where} needs at least {schema['minItems']} items"
    for i, item in enumerate(value):
        problem = schema_error(item, schema.get("items"), f"{where}[{i}]", budget, depth)
        if problem is not None:
            return problem
    return None


def _object_error(value: Any, schema: dict[str, Any], where: str, budget: _Budget,
                  depth: int) -> str | None:
    if not isinstance(value, dict):
        return None
    properties = schema.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    for name in schema.get("required") or ():
        if name not in value:
            return f"{where} lacks the required {name!r}"
    if schema.get("additionalProperties") is False:
        extra = sorted(set(value) - set(properties))
        if extra:
            return f"{where} has unknown properties {extra}"
    for name, item in value.items():
        problem = schema_error(item, properties.get(name), f"{where}.{name}", budget, depth)
        if problem is not None:
            return problem
    return None


def _is(value: Any, kind: str) -> bool:
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _TYPES.get(kind, (object,)))


class RecoveryHint:
    def __init__(self, pattern: str, hint: str) -> None:
        self.pattern = re.compile(pattern)
        self.hint = hint

    async def on_observation(self, observations: list[Observation], state: Any) -> Inject | None:
        failed = [o for o in observations if self.pattern.search(o.content)]
        if not failed:
            return None
        names = ", ".join(sorted({o.name or "a tool" for o in failed}))
        return Inject(
            messages=[{"role": "user", "content": f"{names} reported an error. {self.hint}"}],
            reason=f"error pattern in {names}",
        )


def recovery_hint(
    pattern: str = r"(?i)\berror\b|traceback|exception",
    hint: str = "Read the error, fix the arguments and call the tool again.",
) -> RecoveryHint:
    return RecoveryHint(pattern, hint)
