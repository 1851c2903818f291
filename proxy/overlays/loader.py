"""``--overlay NAME=package.module:factory[,key=value...]``: the operator's code, imported
at start. This is the operator's own code, run in the proxy; code from anyone else is a
runtime patch (``overlays.patches``), installed through the API and run out of process."""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any, NamedTuple

from tracetap.proxy.overlays.hooks import HOOKS

FAIL_MODES = ("open", "closed")  # --overlay-fail
# What after_model judges: the whole reply (streams held to their end), or its tool calls
# only (text before the first tool call is relayed live; docs/overlays.md).
AFTER_MODEL_SEES = ("reply", "tool_calls")
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_TARGET = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


class OverlaySpec(NamedTuple):
    name: str
    module: str
    factory: str
    options: dict[str, str]  # passed to the factory as keyword arguments


def parse_spec(value: str) -> OverlaySpec:
    """``NAME=module:factory`` with optional ``,key=value`` options; ValueError if not."""
    name, sep, rest = value.partition("=")
    target, *pairs = rest.split(",")
    if not sep or not _NAME.fullmatch(name) or not _TARGET.fullmatch(target.strip()):
        raise ValueError(
            f"--overlay {value!r}: use NAME=package.module:factory "
            "(NAME of 1-64 characters A-Z a-z 0-9 . _ -)"
        )
    options = {}
    for pair in pairs:
        key, eq, option = pair.partition("=")
        if not eq or not key.strip().isidentifier():
            raise ValueError(f"--overlay {value!r}: options are ,key=value")
        options[key.strip()] = option.strip()
    module, factory = target.strip().split(":")
    return OverlaySpec(name, module, factory, options)


def parse_specs(values: list[str]) -> list[OverlaySpec]:
    specs = [parse_spec(v) for v in values]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"--overlay: each NAME once (got {', '.join(names)})")
    return specs


def load_overlays(values: list[str]) -> dict[str, Any]:
    """Import and build every overlay; a mistake is one clear ValueError."""
    overlays = {}
    for spec in parse_specs(values):
        try:
            module = importlib.import_module(spec.module)
        except ImportError as exc:
            raise ValueError(f"--overlay {spec.name}: cannot import {spec.module}: {exc}") from exc
        factory = getattr(module, spec.factory, None)
        if not callable(factory):
            raise ValueError(
                f"--overlay {spec.name}: {spec.module} has no callable {spec.factory!r}"
            )
        try:
            overlay = factory(**spec.options)
        except Exception as exc:
            raise ValueError(
                f"--overlay {spec.name}: {spec.module}:{spec.factory}"
                f"({', '.join(spec.options)}) failed: {exc}"
            ) from exc
        hooks = [h for h in HOOKS if getattr(overlay, h, None) is not None]
        if not hooks:
            raise ValueError(
                f"--overlay {spec.name}: the object has none of the hooks {', '.join(HOOKS)}"
            )
        for hook in hooks:
            if not inspect.iscoroutinefunction(getattr(overlay, hook)):
                # A blocking hook would stall every call and could not be timed out.
                raise ValueError(f"--overlay {spec.name}: {hook} must be an async function")
        sees = getattr(overlay, "after_model_sees", "reply")
        if sees not in AFTER_MODEL_SEES:
            raise ValueError(
                f"--overlay {spec.name}: after_model_sees is {sees!r}, not one of "
                f"{', '.join(AFTER_MODEL_SEES)}"
            )
        overlays[spec.name] = overlay
    return overlays
