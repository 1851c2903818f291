"""The Responses API's own objects, built from chat's: output items (reasoning, message,
function call), content parts with logprobs, the status and usage, and the ``response``
envelope echoing the request. Shared by the whole-reply and the stream translation.
"""

from __future__ import annotations

from typing import Any

from tracetap.proxy.apis.chat.reply import Usage
from tracetap.proxy.apis.responses.request import EFFORTS, TOOL_CHOICES


class Items:
    """Output item ids: derived from the response id, so one reply always reads the same."""

    def __init__(self, response_id: str):
        self._stem = response_id.removeprefix("resp_")
        self._count = 0

    def next_id(self, prefix: str) -> str:
        item_id = f"{prefix}_{self._stem}_{self._count}"
        self._count += 1
        return item_id


def call_id(item_id: str) -> str:
    return "call_" + item_id.removeprefix("fc_")


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def message_item(item_id: str, text: str, logprobs: list[dict[str, Any]],
                  status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text, logprobs)]}


def call_item(item_id: str, call_id: str, name: str, arguments: str,
               status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_logprobs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for entry in entries:
        token, logprob = entry.get("token"), entry.get("logprob")
        if not isinstance(token, str) or not _is_number(logprob):
            continue
        tops = [{"token": t["token"], "logprob": t["logprob"], "bytes": _bytes(t)}
                for t in entry.get("top_logprobs") or ()
                if isinstance(t, dict) and isinstance(t.get("token"), str)
                and _is_number(t.get("logprob"))]
        out.append({"token": token, "logprob": logprob, "bytes": _bytes(entry),
                    "top_logprobs": tops})
    return out


def delta_logprobs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                              for t in e["top_logprobs"]]}
            for e in entries]


def _bytes(entry: dict[str, Any]) -> list[int]:
    raw = entry.get("bytes")
    if isinstance(raw, list) and all(isinstance(b, int) for b in raw):
        return raw
    return list(entry["token"].encode())


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def status_of(finish_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def usage_of(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt,
        "input_tokens_details": {"cached_tokens": usage.cached or 0, "cache_write_tokens": 0},
        "output_tokens": usage.completion,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning or 0},
        "total_tokens": usage.total,
    }


def response_object(req: dict[str, Any], rid: str, created: int,
                    output: list[dict[str, Any]], status: str,
                    incomplete: dict[str, Any] | None, usage: Usage | None) -> dict[str, Any]:
    """The response object; request settings echoed as the Responses API does."""
    metadata = req.get("metadata")
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": _echo(req, "instructions", str),
        "max_output_tokens": _echo(req, "max_output_tokens", int),
        "max_tool_calls": None,
        "metadata": metadata if isinstance(metadata, dict) else {},
        "model": _echo(req, "model", str) or "",
        "output": output,
        "parallel_tool_calls": _echo(req, "parallel_tool_calls", bool) is not False,
        "previous_response_id": None,
        "reasoning": _echo_reasoning(req.get("reasoning")),
        "temperature": _echo(req, "temperature", (int, float)),
        "text": req["text"] if isinstance(req.get("text"), dict) else {"format": {"type": "text"}},
        "tool_choice": _echo_tool_choice(req.get("tool_choice")),
        "tools": _echo_tools(req.get("tools")),
        "top_p": _echo(req, "top_p", (int, float)),
        "truncation": "disabled",
        "usage": usage_of(usage),
        "user": _echo(req, "user", str),
    }


def _echo(req: dict[str, Any], key: str, kind: Any) -> Any:
    value = req.get(key)
    if isinstance(value, bool) and kind is not bool:
        return None
    return value if isinstance(value, kind) else None


def _echo_reasoning(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        return None
    effort, summary = value.get("effort"), value.get("summary")
    return {"effort": effort if effort in (*EFFORTS, "minimal", "none") else None,
            "summary": summary if summary in ("auto", "concise", "detailed") else None}


def _echo_tool_choice(value: Any) -> Any:
    if value in TOOL_CHOICES:
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(
            value.get("name"), str):
        return {"type": "function", "name": value["name"]}
    return "auto"


def _echo_tools(value: Any) -> list[dict[str, Any]]:
    tools = []
    for tool in value if isinstance(value, list) else ():
        if isinstance(tool, dict) and tool.get("type") == "function" and isinstance(
                tool.get("name"), str):
            tools.append({"type": "function", "name": tool["name"],
                          "description": tool.get("description"),
                          "parameters": tool.get("parameters"), "strict": tool.get("strict")})
    return tools
