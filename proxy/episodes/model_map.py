"""``--model-map``: harnesses that send their own model names (``claude-*``) get the
engine's model instead. First matching rule wins; shell-style patterns."""

from __future__ import annotations

import fnmatch
from typing import Any


class ModelMap:
    def __init__(self, rules: list[str] | tuple[str, ...] = ()):
        self.rules: list[tuple[str, str]] = []
        for rule in rules:
            pattern, sep, target = rule.partition("=")
            if not sep or not pattern.strip() or not target.strip():
                raise ValueError(f"--model-map {rule!r}: use PATTERN=MODEL, e.g. 'claude-*=qwen3'")
            self.rules.append((pattern.strip(), target.strip()))

    def apply(self, payload: dict[str, Any]) -> None:
        """Rewrite ``payload["model"]`` in place (the first rule that matches)."""
        model = payload.get("model")
        if not self.rules or not isinstance(model, str):
            return
        for pattern, target in self.rules:
            if fnmatch.fnmatchcase(model, pattern):
                payload["model"] = target
                return
