"""OpenAI Responses API → chat completions: the request side of translation.

``to_chat`` turns a Responses request into a chat-completions request; anything without a
faithful chat equivalent raises ``Untranslatable`` (docs/translation.md lists what is
translated, dropped and rejected).
"""

from __future__ import annotations

from typing import Any

from tracetap.proxy.apis.chat_request import (
    ModelMap,
    as_list,
    as_object,
    as_str,
    chat_content,
    encode_arguments,
    image_part,
    mapped_model,
    optional_bool,
    optional_int,
    optional_number,
    text_part,
)
from tracetap.proxy.apis.translate_errors import Untranslatable

# Fields that only make sense with state kept by the server that answered before.
_STATEFUL = {
    "previous_response_id": "needs the earlier response stored server-side; resend the "
                            "whole conversation in `input` instead (as with store: false)",
    "conversation": "needs a conversation stored server-side",
    "prompt": "refers to a prompt template stored on OpenAI's servers",
    "background": "runs the response as a server-side background job",
    "max_tool_calls": "cannot be enforced by a chat-completions server",
}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TOOL_CHOICES = ("auto", "none", "required")
EFFORTS = ("low", "medium", "high")
_LOGPROBS = "message.output_text.logprobs"


# ---- request -----------------------------------------------------------------------------


def to_chat(request: dict, *, model_map: ModelMap | None = None) -> dict:
    """A Responses request body → a chat-completions request body."""
    req = as_object(request, None, "the request body")
    for key, why in _STATEFUL.items():
        if req.get(key) not in (None, False):
            raise Untranslatable(f"`{key}` {why}", key)
    chat: dict[str, Any] = {}
    model = mapped_model(req, model_map)
    if model is not None:
        chat["model"] = model
    messages: list[dict[str, Any]] = []
    instructions = req.get("instructions")
    if instructions is not None:
        messages.append({"role": "system", "content": as_str(instructions, "instructions")})
    messages.extend(_input_messages(req.get("input")))
    chat["messages"] = messages
    if req.get("tools") is not None:
        tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(as_list(req["tools"], "tools"))]
        if tools:
            chat["tools"] = tools
    if req.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(req["tool_choice"])
    if optional_int(req, "max_output_tokens") is not None:
        chat["max_tokens"] = req["max_output_tokens"]
    for key in ("temperature", "top_p"):
        if optional_number(req, key) is not None:
            chat[key] = req[key]
    if optional_bool(req, "parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = req["parallel_tool_calls"]
    if isinstance(req.get("user"), str):
        chat["user"] = req["user"]
    _reasoning_options(req, chat)
    _text_options(req, chat)
    _logprob_options(req, chat)
    if optional_bool(req, "stream"):
        chat["stream"] = True
        # Responses always report usage; a chat stream does only when asked.
        chat["stream_options"] = {"include_usage": True}
    return chat


def _input_messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise Untranslatable("`input` is required (the whole conversation, resent each turn)",
                             "input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    history = _History()
    for i, item in enumerate(as_list(value, "input")):
        history.add(as_object(item, f"input[{i}]", f"`input[{i}]`"), f"input[{i}]")
    return history.messages


class _History:
    """Input items → chat messages. A function_call joins the assistant message just
    before it (one chat turn: text + tool_calls); plaintext reasoning goes to the next
    assistant message as ``reasoning_content`` for the template to render or drop."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._assistant: dict[str, Any] | None = None  # the turn function_calls join
        self._reasoning: list[str] = []

    def add(self, item: dict[str, Any], param: str) -> None:
        kind = item.get("type")
        if kind is None and "role" in item:
            kind = "message"
        if kind == "message":
            self._message(item, param)
        elif kind == "function_call":
            self._function_call(item, param)
        elif kind == "function_call_output":
            self._assistant, self._reasoning = None, []
            self.messages.append({
                "role": "tool",
                "tool_call_id": as_str(item.get("call_id"), f"{param}.call_id"),
                "content": _content(item.get("output"), f"{param}.output", images=False),
            })
        elif kind == "reasoning":
            self._assistant = None
            self._reasoning.extend(_reasoning_text(item, param))
        elif kind == "item_reference":
            raise Untranslatable(
                f"`{param}`: an item_reference points at an item stored server-side; "
                "send the item itself", f"{param}.type")
        else:
            raise Untranslatable(
                f"`{param}`: input item type {kind!r} (a hosted or server-side tool item) has "
                "no chat-completions equivalent", f"{param}.type")

    def _message(self, item: dict[str, Any], param: str) -> None:
        role = item.get("role")
        role = _ROLES.get(role) if isinstance(role, str) else None
        if role is None:
            raise Untranslatable(f"`{param}.role` must be one of {sorted(_ROLES)}",
                                 f"{param}.role")
        content = _content(item.get("content"), f"{param}.content", images=role == "user")
        message: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            self._take_reasoning(message)
            self._assistant = message
        else:
            self._assistant, self._reasoning = None, []
        self.messages.append(message)

    def _function_call(self, item: dict[str, Any], param: str) -> None:
        arguments = item.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = encode_arguments(arguments, f"{param}.arguments")
        call = {
            "id": as_str(item.get("call_id"), f"{param}.call_id"),
            "type": "function",
            "function": {"name": as_str(item.get("name"), f"{param}.name"),
                         "arguments": arguments},
        }
        if self._assistant is None:
            self._assistant = {"role": "assistant", "content": None}
            self._take_reasoning(self._assistant)
            self.messages.append(self._assistant)
        self._assistant.setdefault("tool_calls", []).append(call)

    def _take_reasoning(self, message: dict[str, Any]) -> None:
        if self._reasoning:
            message["reasoning_content"] = "".join(self._reasoning)
            self._reasoning = []


def _reasoning_text(item: dict[str, Any], param: str) -> list[str]:
    """The plaintext reasoning of a reasoning item. Summaries are not the model's reasoning
    and encrypted_content is readable only by the provider that issued it: both dropped."""
    content = item.get("content")
    if content is None:
        return []
    texts = []
    for j, part in enumerate(as_list(content, f"{param}.content")):
        part = as_object(part, f"{param}.content[{j}]", f"`{param}.content[{j}]`")
        if part.get("type") == "reasoning_text":
            texts.append(as_str(part.get("text"), f"{param}.content[{j}].text"))
    return texts


def _content(value: Any, param: str, *, images: bool) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise Untranslatable(f"`{param}` must be a string or an array of content parts", param)
    parts = []
    for j, part in enumerate(value):
        where = f"{param}[{j}]"
        part = as_object(part, where, f"`{where}`")
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            parts.append(text_part(as_str(part.get("text"), f"{where}.text")))
        elif kind == "refusal":
            parts.append(text_part(as_str(part.get("refusal"), f"{where}.refusal")))
        elif kind == "input_image" and images:
            url = part.get("image_url")
            if not isinstance(url, str):
                raise Untranslatable(
                    f"`{where}`: only images given by `image_url` (a URL or data URL) can be "
                    "translated; `file_id` refers to a file stored on OpenAI's servers",
                    f"{where}.image_url")
            parts.append(image_part(url, part.get("detail")))
        elif kind == "input_image":
            raise Untranslatable(f"`{where}`: chat completions accept images only in user "
                                 "messages", f"{where}.type")
        else:
            raise Untranslatable(f"`{where}`: content part type {kind!r} has no "
                                 "chat-completions equivalent", f"{where}.type")
    return chat_content(parts)


def _tool(value: Any, param: str) -> dict[str, Any]:
    tool = as_object(value, param, f"`{param}`")
    kind = tool.get("type")
    if kind != "function":
        raise Untranslatable(
            f"`{param}`: tool type {kind!r} is a hosted tool that OpenAI's servers run; a "
            "chat-completions upstream can only call function tools", f"{param}.type")
    function: dict[str, Any] = {"name": as_str(tool.get("name"), f"{param}.name")}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _tool_choice(value: Any) -> Any:
    if value in TOOL_CHOICES:
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function",
                "function": {"name": as_str(value.get("name"), "tool_choice.name")}}
    kind = value.get("type") if isinstance(value, dict) else value
    raise Untranslatable(f"`tool_choice` {kind!r} cannot be translated: chat completions know "
                         "only auto, none, required and one named function", "tool_choice")


def _reasoning_options(req: dict[str, Any], chat: dict[str, Any]) -> None:
    """``reasoning.effort`` low/medium/high → ``reasoning_effort``; other efforts and
    ``summary`` have no chat equivalent and are dropped (the model reasons as it would)."""
    reasoning = req.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") in EFFORTS:
        chat["reasoning_effort"] = reasoning["effort"]


def _text_options(req: dict[str, Any], chat: dict[str, Any]) -> None:
    text = req.get("text")
    if text is None:
        return
    fmt = as_object(text, "text", "`text`").get("format")
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


def _logprob_options(req: dict[str, Any], chat: dict[str, Any]) -> None:
    top = optional_int(req, "top_logprobs")
    if wants_logprobs(req):
        chat["logprobs"] = True
        if top:
            chat["top_logprobs"] = top


def wants_logprobs(req: dict[str, Any]) -> bool:
    include = req.get("include")
    asked = isinstance(include, list) and _LOGPROBS in include
    top = req.get("top_logprobs")
    return asked or (isinstance(top, int) and not isinstance(top, bool) and top > 0)
