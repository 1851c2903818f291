"""OpenAI Responses API → chat completions: the request side of translation.

``to_chat`` turns a Responses request into a chat-completions request (the ``input``
items in ``history.py``). It is tolerant: what the engine cannot use (hosted tools,
summaries, cache keys, unknown fields) is dropped and counted in ``dropped``; only
content with no chat form at all raises ``Untranslatable`` (docs/translation.md lists
what is translated, dropped and rejected).
"""

from __future__ import annotations

from typing import Any

from tracetap.proxy.apis.chat.request import (
    ModelMap,
    as_list,
    as_object,
    as_str,
    mapped_model,
    optional_bool,
    optional_int,
    optional_number,
)
from tracetap.proxy.apis.dropped import Dropped, drop_unknown
from tracetap.proxy.apis.reasoning_options import EFFORTS, reasoning_options
from tracetap.proxy.apis.responses.history import input_messages
from tracetap.proxy.apis.translate_errors import Untranslatable

# Fields that only make sense with state kept by the server that answered before.
_STATEFUL = {
    "previous_response_id": "needs the earlier response stored server-side; resend the "
                            "whole conversation in `input` instead (as with store: false)",
    "conversation": "needs a conversation stored server-side",
    "prompt": "refers to a prompt template stored on OpenAI's servers",
    "background": "runs the response as a server-side background job",
}
_READ = frozenset({"model", "input", "instructions", "tools", "tool_choice",
                   "max_output_tokens", "temperature", "top_p", "parallel_tool_calls", "user",
                   "reasoning", "text", "include", "top_logprobs", "stream", *_STATEFUL})
_NAMES = {"client_metadata": "metadata", "prompt_cache_retention": "prompt_cache_key"}
TOOL_CHOICES = ("auto", "none", "required")
_LOGPROBS = "message.output_text.logprobs"

__all__ = ["EFFORTS", "TOOL_CHOICES", "to_chat", "wants_logprobs"]


# ---- request -----------------------------------------------------------------------------


def to_chat(request: dict, *, model_map: ModelMap | None = None,
            dropped: Dropped | None = None, flavor: str | None = None) -> dict:
    """A Responses request body → a chat-completions request body; what is left out is
    counted in ``dropped``; ``flavor`` decides which reasoning options the engine takes."""
    req = as_object(request, None, "the request body")
    drops = dropped if dropped is not None else Dropped()
    for key, why in _STATEFUL.items():
        if req.get(key) not in (None, False):
            raise Untranslatable(f"`{key}` {why}", key)
    drop_unknown(req, _READ, drops, _NAMES)
    chat: dict[str, Any] = {}
    model = mapped_model(req, model_map)
    if model is not None:
        chat["model"] = model
    messages: list[dict[str, Any]] = []
    instructions = req.get("instructions")
    if instructions is not None:
        messages.append({"role": "system", "content": as_str(instructions, "instructions")})
    messages.extend(input_messages(req.get("input"), drops))
    chat["messages"] = messages
    _tools(req, chat, drops)
    _sampling(req, chat)
    _reasoning_options(req, chat, drops, flavor)
    _text_options(req, chat, drops)
    _logprob_options(req, chat, drops)
    if optional_bool(req, "stream"):
        chat["stream"] = True
        # Responses always report usage; a chat stream does only when asked.
        chat["stream_options"] = {"include_usage": True}
    return chat


def _tools(req: dict[str, Any], chat: dict[str, Any], drops: Dropped) -> None:
    names: set[str] = set()
    if req.get("tools") is not None:
        tools = [_tool(t, f"tools[{i}]", drops)
                 for i, t in enumerate(as_list(req["tools"], "tools"))]
        tools = [t for t in tools if t is not None]
        names = {t["function"]["name"] for t in tools}
        if tools:
            chat["tools"] = tools
    if req.get("tool_choice") is not None:
        choice = _tool_choice(req["tool_choice"], names)
        if choice is None:
            drops.add("tool_choice")  # hosted, allowed_tools, or a dropped tool: engine picks
        elif "tools" in chat:  # engines refuse a tool_choice without tools
            chat["tool_choice"] = choice


def _sampling(req: dict[str, Any], chat: dict[str, Any]) -> None:
    if optional_int(req, "max_output_tokens") is not None:
        chat["max_tokens"] = req["max_output_tokens"]
    for key in ("temperature", "top_p"):
        if optional_number(req, key) is not None:
            chat[key] = req[key]
    if optional_bool(req, "parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = req["parallel_tool_calls"]
    if isinstance(req.get("user"), str):
        chat["user"] = req["user"]


def _tool(value: Any, param: str, dropped: Dropped) -> dict[str, Any] | None:
    """A function tool → a chat tool. Hosted tools (web_search, file_search, …) run on
    OpenAI's servers, custom (free-form grammar) and namespace tools have no chat form:
    dropped and counted; the engine never sees them."""
    tool = as_object(value, param, f"`{param}`")
    kind = tool.get("type")
    if kind != "function":
        dropped.add("hosted_tool")
        return None
    function: dict[str, Any] = {"name": as_str(tool.get("name"), f"{param}.name")}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _tool_choice(value: Any, names: set[str]) -> Any:
    """The chat tool_choice, or None when it has no chat form (hosted, allowed_tools) or
    names a tool that was dropped."""
    if value in TOOL_CHOICES:
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        name = as_str(value.get("name"), "tool_choice.name")
        if name in names:
            return {"type": "function", "function": {"name": name}}
    return None


def _reasoning_options(req: dict[str, Any], chat: dict[str, Any], dropped: Dropped,
                       flavor: str | None) -> None:
    """``reasoning.effort`` → the engine's reasoning options (``reasoning_options.py``:
    ``none`` switches thinking off where the engine can); ``summary`` has no chat
    equivalent: dropped (the reply carries the reasoning itself, when there is any)."""
    reasoning = req.get("reasoning")
    if reasoning is None:
        return
    reasoning = as_object(reasoning, "reasoning", "`reasoning`")
    drop_unknown(reasoning, {"effort"}, dropped, {"summary": "reasoning_summary",
                                                  "generate_summary": "reasoning_summary"})
    effort = reasoning.get("effort")
    chat.update(reasoning_options(effort=None if effort == "none" else effort,
                                  thinking=False if effort == "none" else None,
                                  flavor=flavor, dropped=dropped))


def _text_options(req: dict[str, Any], chat: dict[str, Any], dropped: Dropped) -> None:
    text = req.get("text")
    if text is None:
        return
    text = as_object(text, "text", "`text`")
    drop_unknown(text, {"format"}, dropped)
    fmt = text.get("format")
    if fmt is None:
        return
    fmt = as_object(fmt, "text.format", "`text.format`")
    kind = fmt.get("type")
    if kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif kind == "json_schema":
        schema: dict[str, Any] = {"name": as_str(fmt.get("name"), "text.format.name")}
        for key in ("schema", "strict", "description"):
            if fmt.get(key) is not None:
                schema[key] = fmt[key]
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif kind != "text":
        raise Untranslatable(f"`text.format` type {kind!r} has no chat-completions equivalent",
                             "text.format.type")


def _logprob_options(req: dict[str, Any], chat: dict[str, Any], dropped: Dropped) -> None:
    top = optional_int(req, "top_logprobs")
    include = req.get("include")
    if include is not None:
        # reasoning.encrypted_content and the like: replies carry no such thing.
        others = [x for x in as_list(include, "include") if x != _LOGPROBS]
        if others:
            dropped.add("include", len(others))
    if wants_logprobs(req):
        chat["logprobs"] = True
        if top:
            chat["top_logprobs"] = top


def wants_logprobs(req: dict[str, Any]) -> bool:
    include = req.get("include")
    asked = isinstance(include, list) and _LOGPROBS in include
    top = req.get("top_logprobs")
    return asked or (isinstance(top, int) and not isinstance(top, bool) and top > 0)
