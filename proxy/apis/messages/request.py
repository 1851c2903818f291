"""Anthropic Messages API → chat completions: the request side of translation.

``to_chat`` turns a Messages request into a chat-completions request; anything without a
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

_SERVER_SIDE = {
    "container": "names a code-execution container on Anthropic's servers",
    "mcp_servers": "asks Anthropic's servers to call MCP servers",
}


def to_chat(request: dict, *, model_map: ModelMap | None = None) -> dict:
    """A Messages request body → a chat-completions request body."""
    req = as_object(request, None, "the request body")
    for key, why in _SERVER_SIDE.items():
        if req.get(key) is not None:
            raise Untranslatable(f"`{key}` {why}; a chat-completions upstream cannot", key)
    chat: dict[str, Any] = {}
    model = mapped_model(req, model_map)
    if model is not None:
        chat["model"] = model
    messages: list[dict[str, Any]] = []
    if req.get("system") is not None:
        messages.append({"role": "system", "content": _system(req["system"])})
    turns = as_list(req.get("messages"), "messages")
    for i, turn in enumerate(turns):
        messages.extend(_turn(as_object(turn, f"messages[{i}]", f"`messages[{i}]`"),
                              f"messages[{i}]"))
    chat["messages"] = messages
    if turns and isinstance(turns[-1], dict) and turns[-1].get("role") == "assistant":
        # A final assistant turn is a prefill the reply continues (vLLM/SGLang options;
        # llama.cpp continues a final assistant message by itself).
        chat["add_generation_prompt"] = False
        chat["continue_final_message"] = True
    if req.get("tools") is not None:
        tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(as_list(req["tools"], "tools"))]
        if tools:
            chat["tools"] = tools
    if req.get("tool_choice") is not None:
        _tool_choice(as_object(req["tool_choice"], "tool_choice", "`tool_choice`"), chat)
    if optional_int(req, "max_tokens") is not None:
        chat["max_tokens"] = req["max_tokens"]
    for key in ("temperature", "top_p"):
        if optional_number(req, key) is not None:
            chat[key] = req[key]
    if optional_int(req, "top_k") is not None:
        chat["top_k"] = req["top_k"]  # vLLM, SGLang and llama.cpp accept it on chat too
    if req.get("stop_sequences") is not None:
        stops = as_list(req["stop_sequences"], "stop_sequences")
        chat["stop"] = [as_str(s, f"stop_sequences[{i}]") for i, s in enumerate(stops)]
    if req.get("output_format") is not None:
        chat["response_format"] = _output_format(req["output_format"])
    if optional_bool(req, "stream"):
        chat["stream"] = True
        # message_delta reports usage; a chat stream does only when asked.
        chat["stream_options"] = {"include_usage": True}
    return chat


def _system(value: Any) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        return value
    parts = []
    for i, block in enumerate(as_list(value, "system")):
        block = as_object(block, f"system[{i}]", f"`system[{i}]`")
        if block.get("type") != "text":
            raise Untranslatable(f"`system[{i}]`: only text blocks can be translated",
                                 f"system[{i}].type")
        parts.append(text_part(as_str(block.get("text"), f"system[{i}].text")))
    return chat_content(parts)


def _turn(turn: dict[str, Any], param: str) -> list[dict[str, Any]]:
    role = turn.get("role")
    content = turn.get("content")
    if role == "user":
        return _user(content, param)
    if role == "assistant":
        return [_assistant(content, param)]
    raise Untranslatable(f"`{param}.role` must be user or assistant", f"{param}.role")


def _user(content: Any, param: str) -> list[dict[str, Any]]:
    """A user turn → tool messages for its tool_result blocks, user messages for the rest,
    in their order (Anthropic puts tool results first, as chat needs them)."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    _must_be_blocks(content, f"{param}.content")
    messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"{param}.content[{j}]"
        block = as_object(block, where, f"`{where}`")
        kind = block.get("type")
        if kind == "tool_result":
            if parts:
                messages.append({"role": "user", "content": chat_content(parts)})
                parts = []
            messages.append({
                "role": "tool",
                "tool_call_id": as_str(block.get("tool_use_id"), f"{where}.tool_use_id"),
                "content": _tool_result(block.get("content"), f"{where}.content"),
            })
        else:
            parts.append(_part(block, where, images=True))
    if parts or not messages:
        messages.append({"role": "user", "content": chat_content(parts)})
    return messages


def _assistant(content: Any, param: str) -> dict[str, Any]:
    """An assistant turn → one chat assistant message: text, tool_calls, and the thinking
    text as ``reasoning_content`` (the engine's template renders or drops it)."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    _must_be_blocks(content, f"{param}.content")
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for j, block in enumerate(content):
        where = f"{param}.content[{j}]"
        block = as_object(block, where, f"`{where}`")
        kind = block.get("type")
        if kind == "tool_use":
            name = as_str(block.get("name"), f"{where}.name")
            arguments = encode_arguments(
                as_object(block.get("input"), f"{where}.input", f"`{where}.input`"),
                f"{where}.input")
            calls.append({"id": as_str(block.get("id"), f"{where}.id"), "type": "function",
                          "function": {"name": name, "arguments": arguments}})
        elif kind == "thinking":
            thinking.append(as_str(block.get("thinking"), f"{where}.thinking"))
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic: no engine can read it (docs/translation.md)
        else:
            parts.append(_part(block, where, images=False))
    message: dict[str, Any] = {"role": "assistant",
                               "content": chat_content(parts) if parts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "\n\n".join(thinking)
    return message


def _must_be_blocks(content: Any, param: str) -> None:
    if not isinstance(content, list):
        raise Untranslatable(f"`{param}` must be a string or an array of content blocks", param)


def _part(block: dict[str, Any], where: str, *, images: bool) -> dict[str, Any]:
    kind = block.get("type")
    if kind == "text":
        return text_part(as_str(block.get("text"), f"{where}.text"))
    if kind == "image" and images:
        return image_part(_image_url(block, where))
    if kind == "image":
        raise Untranslatable(f"`{where}`: chat completions accept images only in user messages",
                             f"{where}.type")
    raise Untranslatable(f"`{where}`: content block type {kind!r} has no chat-completions "
                         "equivalent", f"{where}.type")


def _image_url(block: dict[str, Any], where: str) -> str:
    source = as_object(block.get("source"), f"{where}.source", f"`{where}.source`")
    kind = source.get("type")
    if kind == "base64":
        media = as_str(source.get("media_type"), f"{where}.source.media_type")
        return f"data:{media};base64,{as_str(source.get('data'), f'{where}.source.data')}"
    if kind == "url":
        return as_str(source.get("url"), f"{where}.source.url")
    raise Untranslatable(f"`{where}.source`: image source {kind!r} cannot be translated (only "
                         "base64 and url; a file id refers to Anthropic's file storage)",
                         f"{where}.source.type")


def _tool_result(content: Any, param: str) -> str | list[dict[str, Any]]:
    """A tool_result's content; ``is_error`` has no chat equivalent (the text stays)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    _must_be_blocks(content, param)
    parts = []
    for j, block in enumerate(content):
        where = f"{param}[{j}]"
        block = as_object(block, where, f"`{where}`")
        if block.get("type") != "text":
            raise Untranslatable(f"`{where}`: a tool result can be translated only with text "
                                 f"content (chat tool messages carry text), not "
                                 f"{block.get('type')!r}", f"{where}.type")
        parts.append(text_part(as_str(block.get("text"), f"{where}.text")))
    return chat_content(parts)


def _tool(value: Any, param: str) -> dict[str, Any]:
    tool = as_object(value, param, f"`{param}`")
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise Untranslatable(
            f"`{param}`: tool type {kind!r} is an Anthropic-defined tool (its schema and, for "
            "server tools, its execution live at Anthropic); only custom tools with an "
            "input_schema can be translated", f"{param}.type")
    function: dict[str, Any] = {"name": as_str(tool.get("name"), f"{param}.name")}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    if tool.get("input_schema") is not None:
        function["parameters"] = tool["input_schema"]
    if isinstance(tool.get("strict"), bool):
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any], chat: dict[str, Any]) -> None:
    kind = choice.get("type")
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool":
        name = as_str(choice.get("name"), "tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise Untranslatable(f"`tool_choice.type` {kind!r} is not one of auto, any, tool, none",
                             "tool_choice.type")
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


def _output_format(value: Any) -> dict[str, Any]:
    fmt = as_object(value, "output_format", "`output_format`")
    if fmt.get("type") != "json_schema":
        raise Untranslatable("`output_format.type` must be json_schema", "output_format.type")
    schema = as_object(fmt.get("schema"), "output_format.schema", "`output_format.schema`")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
