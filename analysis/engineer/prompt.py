"""What the engineer model is asked (failure packets and the patch contract) and how its
reply becomes a patch (the first fenced Python block)."""

from __future__ import annotations

import re
from typing import Any

import msgspec

SYSTEM = """You improve an agent harness you cannot change, through an overlay patch: \
Python source with some of these module-level async functions (docs/overlays.md):

async def on_episode_start(episode): -> the state (episode: id, task_id, harness, metadata)
async def on_observation(observations, state): -> Inject | None
    (observations: list of tool_call_id, name, content)
async def before_model(request, state): -> Inject | None  (request: model, messages, tools)
async def after_model(reply, state): -> Rewrite | Veto | None
    (reply: content, tool_calls, finish_reason, tools, attempt)

Inject(messages=[...], at="end" | "after_system", reason=""), Rewrite(content, tool_calls, \
reason=""), Veto(feedback, reason="") and ToolCall(id, name, arguments) are predefined. \
Set AFTER_MODEL_SEES = "tool_calls" when after_model only judges tool calls. Hooks run \
to their end at once (no asyncio), without network, processes or file writes, under a \
time budget. The standard library's json and re are available.

Read the failed episodes below, find what made them fail, and answer with one patch in a \
```python fenced block that fixes it without breaking episodes that succeed."""

_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def messages(packets: list[Any]) -> list[dict[str, str]]:
    """The engineer's request: the contract, then the packets as JSON (sorted keys)."""
    shown = msgspec.json.encode([msgspec.to_builtins(p) for p in packets], order="sorted")
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Failure packets ({len(packets)}):\n{shown.decode()}"},
    ]


def patch_of(reply: str | None) -> str | None:
    """The patch in the engineer's reply: its first fenced block; None if it has none."""
    found = _BLOCK.search(reply or "")
    return None if found is None else found.group(1)
