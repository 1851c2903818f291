"""A model's chat template rendered the way Hugging Face ``apply_chat_template`` and
llama-cpp-python render it: a sandboxed Jinja2 environment with ``trim_blocks`` and
``lstrip_blocks``, ``tojson``, ``raise_exception`` and ``strftime_now``.

What the template is given is what the engine was given: the request's ``messages``,
``tools``, ``add_generation_prompt`` (default true), ``documents``, the special tokens'
text, and the request's ``chat_template_kwargs``. Whatever differs from the engine's own
rendering shows up as a token count that does not match the engine's usage, and the ids
are then not kept (proxy.tokens.resolve).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(Exception):
    """The template could not render this request."""


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Hugging Face's own filter: jinja's would HTML-escape, which no model was trained on.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str | list | dict, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        # tokenizer_config.json may hold several named templates: "default", "tool_use", ...
        named = _named(source)
        try:
            self._templates = {name: env.from_string(text) for name, text in named.items()}
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template does not parse: {exc}") from exc
        if "default" not in self._templates:
            raise ValueError("no default chat template")
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, request: dict) -> str:
        tools = request.get("tools") or None
        name = "tool_use" if tools and "tool_use" in self._templates else "default"
        kwargs = request.get("chat_template_kwargs")
        context = {
            **(kwargs if isinstance(kwargs, dict) else {}),
            "messages": request.get("messages") or [],
            "tools": tools,
            "documents": request.get("documents"),
            "add_generation_prompt": request.get("add_generation_prompt", True),
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        try:
            return self._templates[name].render(**context)
        except (jinja2.TemplateError, TemplateError, TypeError, ValueError) as exc:
            raise TemplateError(f"the chat template failed on this request: {exc}") from exc


def _named(source: str | list | dict) -> dict[str, str]:
    if isinstance(source, str):
        return {"default": source}
    if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
        return {str(t.get("name")): str(t.get("template")) for t in source
                if isinstance(t, dict)}
    if isinstance(source, dict):
        return {str(k): str(v) for k, v in source.items()}
    raise ValueError("a chat template is a string or a list of named templates")
