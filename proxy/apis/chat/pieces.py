"""One choice's pieces as a reply or a stream arrives (``Pieces``), and what is read
back from them: its completion ids and where they came from, its logprobs as a reply
would carry them (proxy.apis.chat.capture accumulates into them)."""

from __future__ import annotations

from typing import Any

from tracetap.proxy.apis.chat.wire import ToolCall

_TOKEN_ID_PREFIX = "token_id:"


class Pieces:
    """One choice's pieces as they arrive."""

    __slots__ = ("engine_ids", "finish_reason", "ids", "logprobs", "reasoning", "role", "stop",
                 "text", "tokens", "tools", "tops")

    def __init__(self) -> None:
        self.role: str | None = None
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.tools: dict[int, dict[str, Any]] = {}
        self.engine_ids: list[int] | None = None
        self.logprobs: list[float | None] = []
        self.tokens: list[str | None] = []
        self.ids: list[int | None] = []
        self.tops: list[Any] = []
        self.finish_reason: str | None = None
        self.stop: dict[str, Any] = {}  # the engine's stop_reason / matched_stop, once set


def add_tool_calls(acc: Pieces, calls: list[ToolCall]) -> None:
    """A message's or a delta's tool-call pieces."""
    for position, call in enumerate(calls):
        index = call.index if call.index is not None else position
        tool = acc.tools.setdefault(index, {"id": None, "type": None, "name": None,
                                            "arguments": []})
        tool["id"] = call.id or tool["id"]
        tool["type"] = call.type or tool["type"]
        if call.function is not None:
            tool["name"] = call.function.name or tool["name"]
            if call.function.arguments:
                tool["arguments"].append(call.function.arguments)


def completion_ids(acc: Pieces) -> tuple[list[int] | None, str]:
    if acc.engine_ids is not None:
        return acc.engine_ids, "engine"
    if acc.tokens and all(t is not None and t.startswith(_TOKEN_ID_PREFIX) for t in acc.tokens):
        try:
            return [int(t[len(_TOKEN_ID_PREFIX):]) for t in acc.tokens], "logprobs"
        except ValueError:
            pass
    if acc.ids and all(i is not None for i in acc.ids):
        return list(acc.ids), "logprobs"
    return None, "none"


def logprobs_view(acc: Pieces, chat: bool) -> dict[str, Any]:
    if chat:
        return {"content": [{"token": t, "logprob": lp} for t, lp in zip(acc.tokens, acc.logprobs)]}
    return {"tokens": acc.tokens, "token_logprobs": acc.logprobs}
