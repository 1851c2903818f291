"""Anthropic Messages API → chat completions: the request side of translation.

``to_chat`` turns a Messages request into a chat-completions request. It is tolerant:
what the engine cannot use (cache hints, thinking budgets, context management, unknown
fields and blocks) is dropped and counted in ``dropped``; only content with no chat form
at all raises ``Untranslatable`` (docs/translation.md lists what is translated, dropped
and rejected).
"""

from __future__ import annotations

from typing import Any

from tracetap.proxy.apis.chat.request import (
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
from tracetap.proxy.apis.dropped import Dropped, drop_unknown
from tracetap.proxy.apis.reasoning_options import reasoning_options
from tracetap.proxy.apis.translate_errors import Untranslatable

_SERVER_SIDE = {
    "container": "names a code-execution container on Anthropic's servers",
    "mcp_servers": "asks Anthropic's servers to call MCP servers",
}
_READ = frozenset({"model", "messages", "system", "max_tokens", "tools", "tool_choice",
                   "temperature", "top_p", "top_k", "stop_sequences", "output_format",
                   "output_config", "thinking", "stream", *_SERVER_SIDE})
_TOOL_KEYS = frozenset({"type", "name", "description", "input_schema", "strict"})


def to_chat(request: dict, *, model_map: ModelMap | None = None,
            dropped: Dropped | None = None, flavor: str | None = None) -> dict:
    """A Messages request body → a chat-completions request body; what is left out is
    counted in ``dropped``; ``flavor`` decides which reasoning options the engine takes."""
    req = as_object(request, None, "the request body")
    drops = dropped if dropped is not None else Dropped()
    for key, why in _SERVER_SIDE.items():
        if req.get(key) is not None:
            raise Untranslatable(f"`{key}` {why}; a chat-completions upstream cannot", key)
    drop_unknown(req, _READ, drops)
    chat: dict[str, Any] = {}
    model = mapped_model(req, model_map)
    if model is not None:
        chat["model"] = model
    turns = _Turns(drops)
    _messages(req, chat, turns)
    _tools(req, chat, turns, drops)
    _sampling(req, chat)
    _output_config(req, chat, drops)
    if req.get("output_format") is not None:
        chat["response_format"] = _output_format(req["output_format"], "output_format")
    chat.update(reasoning_options(effort=_effort(req), thinking=_thinking(req, drops),
                                  flavor=flavor, dropped=drops))
    if optional_bool(req, "stream"):
        chat["stream"] = True
        # message_delta reports usage; a chat stream does only when asked.
        chat["stream_options"] = {"include_usage": True}
    return chat


def _messages(req: dict[str, Any], chat: dict[str, Any], t: _Turns) -> None:
    """``system`` and the turns, in order; a final assistant turn is a prefill."""
    messages: list[dict[str, Any]] = []
    if req.get("system") is not None:
        messages.append({"role": "system", "content": t.system(req["system"], "system")})
    turns = as_list(req.get("messages"), "messages")
    for i, turn in enumerate(turns):
        messages.extend(t.turn(as_object(turn, f"messages[{i}]", f"`messages[{i}]`"),
                               f"messages[{i}]"))
    chat["messages"] = messages
    if turns and isinstance(turns[-1], dict) and turns[-1].get("role") == "assistant":
        # A final assistant turn is a prefill the reply continues (vLLM/SGLang options;
        # llama.cpp continues a final assistant message by itself).
        chat["add_generation_prompt"] = False
        chat["continue_final_message"] = True


def _tools(req: dict[str, Any], chat: dict[str, Any], t: _Turns, drops: Dropped) -> None:
    names: set[str] = set()
    if req.get("tools") is not None:
        tools = [t.tool(x, f"tools[{i}]") for i, x in enumerate(as_list(req["tools"], "tools"))]
        tools = [x for x in tools if x is not None]
        names = {x["function"]["name"] for x in tools}
        if tools:
            chat["tools"] = tools
    if req.get("tool_choice") is not None:
        _tool_choice(as_object(req["tool_choice"], "tool_choice", "`tool_choice`"), chat,
                     names, drops)
        if "tools" not in chat:  # engines refuse a tool_choice without tools
            chat.pop("tool_choice", None)


def _sampling(req: dict[str, Any], chat: dict[str, Any]) -> None:
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


class _Turns:
    """Messages, system prompts and tools → chat, counting what is dropped."""

    def __init__(self, dropped: Dropped):
        self.dropped = dropped

    def system(self, value: Any, param: str) -> str | list[dict[str, Any]]:
        if isinstance(value, str):
            return value
        parts = []
        for i, block in enumerate(as_list(value, param)):
            where = f"{param}[{i}]"
            block = as_object(block, where, f"`{where}`")
            part = self._part(block, where, images=False)
            if part is not None:
                parts.append(part)
        return chat_content(parts)

    def turn(self, turn: dict[str, Any], param: str) -> list[dict[str, Any]]:
        role = turn.get("role")
        content = turn.get("content")
        # A turn's own output_config (a per-turn effort) has no chat form.
        drop_unknown(turn, {"role", "content"}, self.dropped, {"output_config": "effort"})
        if role == "user":
            return self._user(content, param)
        if role == "assistant":
            return [self._assistant(content, param)]
        if role == "system":
            # Current CLIs put system turns among the messages: a system message in place.
            return [{"role": "system", "content": self.system(content, f"{param}.content")}]
        raise Untranslatable(f"`{param}.role` must be user, assistant or system",
                             f"{param}.role")

    def _user(self, content: Any, param: str) -> list[dict[str, Any]]:
        """A user turn → tool messages for its tool_result blocks, user messages for the
        rest, in their order (Anthropic puts tool results first, as chat needs them).
        Images in tool results follow the tool messages in a user message (chat tool
        messages carry text only)."""
        if isinstance(content, str):
            return [{"role": "user", "content": content}]
        _must_be_blocks(content, f"{param}.content")
        messages: list[dict[str, Any]] = []
        parts: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            where = f"{param}.content[{j}]"
            block = as_object(block, where, f"`{where}`")
            if block.get("type") == "tool_result":
                if parts:
                    messages.append({"role": "user", "content": chat_content(parts)})
                    parts = []
                text, images = self._tool_result(block, where)
                messages.append({"role": "tool", "content": text, "tool_call_id": as_str(
                    block.get("tool_use_id"), f"{where}.tool_use_id")})
                parts.extend(images)
            else:
                part = self._part(block, where, images=True)
                if part is not None:
                    parts.append(part)
        if parts or not messages:
            messages.append({"role": "user", "content": chat_content(parts)})
        return messages

    def _assistant(self, content: Any, param: str) -> dict[str, Any]:
        """An assistant turn → one chat assistant message: text, tool_calls, and the
        thinking text as ``reasoning_content`` (the engine's template renders or drops it)."""
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
                self._cache(block)
                name = as_str(block.get("name"), f"{where}.name")
                arguments = encode_arguments(
                    as_object(block.get("input"), f"{where}.input", f"`{where}.input`"),
                    f"{where}.input")
                calls.append({"id": as_str(block.get("id"), f"{where}.id"), "type": "function",
                              "function": {"name": name, "arguments": arguments}})
            elif kind == "thinking":
                if block.get("signature"):  # Anthropic's; tracetap's own replies send ""
                    self.dropped.add("encrypted_reasoning")
                thinking.append(as_str(block.get("thinking"), f"{where}.thinking"))
            elif kind == "redacted_thinking":
                self.dropped.add("encrypted_reasoning")  # no engine can read it
            else:
                part = self._part(block, where, images=False)
                if part is not None:
                    parts.append(part)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": chat_content(parts) if parts or not calls else None}
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["reasoning_content"] = "\n\n".join(thinking)
        return message

    def _part(self, block: dict[str, Any], where: str, *, images: bool) -> dict[str, Any] | None:
        """A text, image or text document block → a chat part; None when dropped."""
        kind = block.get("type")
        self._cache(block)
        if block.get("citations") is not None:
            self.dropped.add("citations")
        if kind == "text":
            return text_part(as_str(block.get("text"), f"{where}.text"))
        if kind == "image" and images:
            return image_part(_image_url(block, where))
        if kind == "image":
            raise Untranslatable(f"`{where}`: chat completions accept images only in user "
                                 "messages", f"{where}.type")
        if kind == "document":
            return text_part(_document_text(block, where))
        self.dropped.add("unknown_block")  # server tool results, future block types
        return None

    def _tool_result(self, block: dict[str, Any], where: str) -> tuple[
            str | list[dict[str, Any]], list[dict[str, Any]]]:
        """A tool_result's text content, and its images; ``is_error`` has no chat
        equivalent (the text stays)."""
        self._cache(block)
        if block.get("is_error") is not None:
            self.dropped.add("is_error")
        content = block.get("content")
        if content is None:
            return "", []
        if isinstance(content, str):
            return content, []
        _must_be_blocks(content, f"{where}.content")
        parts, images = [], []
        for j, inner in enumerate(content):
            at = f"{where}.content[{j}]"
            inner = as_object(inner, at, f"`{at}`")
            part = self._part(inner, at, images=True)
            if part is not None:
                (images if part["type"] == "image_url" else parts).append(part)
        return chat_content(parts), images

    def tool(self, value: Any, param: str) -> dict[str, Any] | None:
        tool = as_object(value, param, f"`{param}`")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            # Anthropic-defined tools (web_search_*, bash_*, …): their schema, and for server
            # tools their execution, live at Anthropic. The engine never sees them.
            self.dropped.add("hosted_tool")
            return None
        if tool.get("defer_loading") is True:
            # Anthropic shows a deferred tool to the model only once tool search loads it
            # (the client then sends it without the flag): not shown here either.
            self.dropped.add("deferred_tool")
            return None
        drop_unknown(tool, _TOOL_KEYS, self.dropped)
        function: dict[str, Any] = {"name": as_str(tool.get("name"), f"{param}.name")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        if tool.get("input_schema") is not None:
            function["parameters"] = tool["input_schema"]
        if isinstance(tool.get("strict"), bool):
            function["strict"] = tool["strict"]
        return {"type": "function", "function": function}

    def _cache(self, block: dict[str, Any]) -> None:
        if block.get("cache_control") is not None:
            self.dropped.add("cache_control")


def _must_be_blocks(content: Any, param: str) -> None:
    if not isinstance(content, list):
        raise Untranslatable(f"`{param}` must be a string or an array of content blocks", param)


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


def _document_text(block: dict[str, Any], where: str) -> str:
    """A plain-text document is text; a PDF or a file id has no chat form."""
    source = as_object(block.get("source"), f"{where}.source", f"`{where}.source`")
    if source.get("type") == "text":
        return as_str(source.get("data"), f"{where}.source.data")
    if source.get("type") == "content" and isinstance(source.get("content"), list):
        texts = [b.get("text") for b in source["content"] if isinstance(b, dict)]
        if all(isinstance(x, str) for x in texts):
            return "\n\n".join(texts)
    raise Untranslatable(f"`{where}`: only plain-text documents can be translated (a PDF or "
                         "a file id has no chat-completions form)", f"{where}.source.type")


def _tool_choice(choice: dict[str, Any], chat: dict[str, Any], names: set[str],
                 dropped: Dropped) -> None:
    kind = choice.get("type")
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool" and as_str(choice.get("name"), "tool_choice.name") in names:
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        dropped.add("tool_choice")  # a dropped tool, or a future kind: the engine picks
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


def _output_config(req: dict[str, Any], chat: dict[str, Any], dropped: Dropped) -> None:
    """``output_config``: ``format`` is structured output; ``effort`` is read by
    ``_effort``; anything else is dropped."""
    config = req.get("output_config")
    if config is None:
        return
    config = as_object(config, "output_config", "`output_config`")
    drop_unknown(config, {"format", "effort"}, dropped)
    if config.get("format") is not None:
        chat["response_format"] = _output_format(config["format"], "output_config.format")


def _effort(req: dict[str, Any]) -> Any:
    config = req.get("output_config")
    return config.get("effort") if isinstance(config, dict) else None


def _thinking(req: dict[str, Any], dropped: Dropped) -> bool | None:
    """``thinking.type``: disabled → False; enabled/adaptive → None (the engine's default:
    it reasons as its template does); a budget has no chat option and is dropped."""
    thinking = req.get("thinking")
    if not isinstance(thinking, dict):
        if thinking is not None:
            dropped.add("thinking")
        return None
    if thinking.get("budget_tokens") is not None:
        dropped.add("thinking")
    drop_unknown(thinking, {"type", "budget_tokens"}, dropped, {"display": "thinking"})
    if thinking.get("type") == "disabled":
        return False
    if thinking.get("type") not in ("enabled", "adaptive"):
        dropped.add("thinking")
    return None


def _output_format(value: Any, param: str) -> dict[str, Any]:
    fmt = as_object(value, param, f"`{param}`")
    if fmt.get("type") != "json_schema":
        raise Untranslatable(f"`{param}.type` must be json_schema", f"{param}.type")
    schema = as_object(fmt.get("schema"), f"{param}.schema", f"`{param}.schema`")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
