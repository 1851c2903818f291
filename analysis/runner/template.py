"""Command templates: ``{base_url}``, ``{episode}``, ``{task.NAME}``, ``{config.NAME}``...
filled so that no value can become shell syntax or split into two arguments."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from typing import Any

import msgspec

# {name} or {name.path}; {{ and }} are literal braces.
_FIELD = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*(?:\.[^{}]+)?)\}")


class TemplateError(ValueError):
    """A template names a value the run does not have (said before anything runs)."""


def text_of(value: Any) -> str:
    """A value as a command sees it: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else msgspec.json.encode(value).decode()


def fill(template: str, values: Mapping[str, Any], what: str = "template") -> str:
    """``template`` with each field replaced by its value's text. ``values`` maps plain
    names (``episode``) to values and ``task`` / ``config`` to dicts read by ``.NAME``."""

    def one(match: re.Match) -> str:
        token = match.group(0)
        if token in ("{{", "}}"):
            return token[0]
        return text_of(_lookup(match.group(1), values, what))

    return _FIELD.sub(one, template)


def _lookup(name: str, values: Mapping[str, Any], what: str) -> Any:
    head, _, rest = name.partition(".")
    if head not in values:
        known = ", ".join(sorted(f"{{{k}}}" for k in values))
        raise TemplateError(f"{what}: unknown field {{{name}}} (known: {known})")
    value = values[head]
    if not rest:
        return value
    if not isinstance(value, Mapping) or rest not in value:
        raise TemplateError(f"{what}: {{{name}}}: {head} has no field {rest!r}")
    return value[rest]


def argv(template: str, values: Mapping[str, Any], *, shell: bool, what: str) -> list[str]:
    """The command to execute. Without ``shell`` the template is split into words first
    and each word filled, so a value is always one argument whatever it holds; with
    ``shell`` each value is quoted for ``sh -c``."""
    if shell:
        quoted = {k: _quoted(v) for k, v in values.items()}
        return ["/bin/sh", "-c", fill(template, quoted, what)]
    try:
        words = shlex.split(template)
    except ValueError as exc:
        raise TemplateError(f"{what}: {exc}") from None
    if not words:
        raise TemplateError(f"{what} is empty")
    return [fill(word, values, what) for word in words]


def _quoted(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: shlex.quote(text_of(v)) for k, v in value.items()}
    return shlex.quote(text_of(value))
