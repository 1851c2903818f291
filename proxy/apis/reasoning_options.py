"""A client's reasoning settings → the chat options an engine takes for them.

Conservative on purpose (docs/translation.md): an option is sent only where it keeps its
meaning, and the model otherwise reasons as its chat template does by default.

- An effort of low, medium or high → ``reasoning_effort`` (OpenAI's chat field; vLLM and
  SGLang pass it to the template, where gpt-oss reads it and others ignore it). Other
  levels (``minimal``, ``max``, ``xhigh``) have no chat equivalent: dropped and counted.
- Thinking switched off (Anthropic ``thinking: {"type": "disabled"}``, Responses effort
  ``none``) → ``chat_template_kwargs: {"enable_thinking": false}`` on vLLM and SGLang,
  the switch Qwen3-style templates read (a template without it ignores it). Other engines
  get no such field (OpenAI rejects unknown fields): dropped and counted.
- Thinking switched on (``enabled``, ``adaptive``) sends nothing: engines that reason do
  so by default, and forcing a template switch could change what other models render.
"""

from __future__ import annotations

from typing import Any

from tracetap.proxy.apis.dropped import Dropped

EFFORTS = ("low", "medium", "high")
_TEMPLATE_KWARGS = ("vllm", "sglang")


def reasoning_options(*, effort: Any, thinking: bool | None, flavor: str | None,
                      dropped: Dropped) -> dict[str, Any]:
    """The chat fields for ``effort`` and ``thinking`` (False: switched off)."""
    out: dict[str, Any] = {}
    if effort in EFFORTS:
        out["reasoning_effort"] = effort
    elif effort is not None:
        dropped.add("effort")
    if thinking is False:
        if flavor in _TEMPLATE_KWARGS:
            out["chat_template_kwargs"] = {"enable_thinking": False}
        else:
            dropped.add("thinking")
    return out
