"""Responses ``input`` items → chat messages (the conversation part of translation).

Tolerant like the rest of translation: items and parts with no chat form that the model
can do without (hosted-tool calls, summaries, encrypted reasoning, future item types)
are dropped and counted; content that cannot be expressed at all (a file, an item stored
server-side) raises ``Untranslatable``.
"""

from __future__ import annotations

from typing import Any

from tracetap.proxy.apis.chat.request import (
    as_list,
    as_object,
    as_str,
    chat_content,
    encode_arguments,
    image_part,
    text_part,
)
from tracetap.proxy.apis.dropped import Dropped
from tracetap.proxy.apis.translate_errors import Untranslatable

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_NO_CHAT_FORM = ("input_file", "input_audio")  # content, not a setting: cannot be dropped


def input_messages(value: Any, dropped: Dropped) -> list[dict[str, Any]]:
    if value is None:
        raise Untranslatable("`input` is required (the whole conversation, resent each turn)",
                             "input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    history = _History(dropped)
    for i, item in enumerate(as_list(value, "input")):
        history.add(as_object(item, f"input[{i}]", f"`input[{i}]`"), f"input[{i}]")
    return history.messages


class _History:
    """Input items → chat messages. A function_call joins the assistant message just
    before it (one chat turn: text + tool_calls); plaintext reasoning goes to the next
    assistant message as ``reasoning_content`` for the template to render or drop."""

    def __init__(self, dropped: Dropped) -> None:
        self.dropped = dropped
        self.messages: list[dict[str, Any]] = []
        self._assistant: dict[str, Any] | None = None  # the turn function_calls join
        self._reasoning: list[str] = []

    def add(self, item: dict[str, Any], param: str) -> None:
        kind = item.get("type")
        if kind is None and "role" in item:
            kind = "message"
        if kind == "message":
            self._message(item, param)
        elif kind in ("function_call", "custom_tool_call"):
            self._function_call(item, param, custom=kind == "custom_tool_call")
        elif kind in ("function_call_output", "custom_tool_call_output"):
            self._assistant, self._reasoning = None, []
            text, images = self.content(item.get("output"), f"{param}.output", images=True,
                                        split_images=True)
            self.messages.append({
                "role": "tool",
                "tool_call_id": as_str(item.get("call_id"), f"{param}.call_id"),
                "content": text,
            })
            if images:  # chat tool messages carry text: the images follow as the user's
                self.messages.append({"role": "user", "content": images})
        elif kind == "reasoning":
            self._assistant = None
            self._reasoning.extend(self._reasoning_text(item, param))
        elif kind == "item_reference":
            raise Untranslatable(
                f"`{param}`: an item_reference points at an item stored server-side; "
                "send the item itself", f"{param}.type")
        else:
            self.dropped.add("unknown_block")  # hosted-tool calls and results, future items

    def _message(self, item: dict[str, Any], param: str) -> None:
        role = item.get("role")
        role = _ROLES.get(role) if isinstance(role, str) else None
        if role is None:
            raise Untranslatable(f"`{param}.role` must be one of {sorted(_ROLES)}",
                                 f"{param}.role")
        content, _ = self.content(item.get("content"), f"{param}.content",
                                  images=role == "user")
        message: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            self._take_reasoning(message)
            self._assistant = message
        else:
            self._assistant, self._reasoning = None, []
        self.messages.append(message)

    def _function_call(self, item: dict[str, Any], param: str, *, custom: bool) -> None:
        key = "input" if custom else "arguments"
        arguments = item.get(key, "")
        if not isinstance(arguments, str):
            arguments = encode_arguments(arguments, f"{param}.{key}")
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

    def _reasoning_text(self, item: dict[str, Any], param: str) -> list[str]:
        """The plaintext reasoning of a reasoning item. Summaries are not the model's
        reasoning and encrypted_content is readable only by the provider that issued it:
        both dropped."""
        if item.get("encrypted_content"):
            self.dropped.add("encrypted_reasoning")
        if item.get("summary"):
            self.dropped.add("reasoning_summary")
        content = item.get("content")
        if content is None:
            return []
        texts = []
        for j, part in enumerate(as_list(content, f"{param}.content")):
            part = as_object(part, f"{param}.content[{j}]", f"`{param}.content[{j}]`")
            if part.get("type") == "reasoning_text":
                texts.append(as_str(part.get("text"), f"{param}.content[{j}].text"))
        return texts

    def content(self, value: Any, param: str, *, images: bool, split_images: bool = False
                ) -> tuple[str | list[dict[str, Any]], list[dict[str, Any]]]:
        """Content parts → chat content, and (``split_images``) the images apart."""
        if isinstance(value, str):
            return value, []
        if not isinstance(value, list):
            raise Untranslatable(f"`{param}` must be a string or an array of content parts",
                                 param)
        parts, pictures = [], []
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
                        f"`{where}`: only images given by `image_url` (a URL or data URL) can "
                        "be translated; `file_id` refers to a file stored on OpenAI's servers",
                        f"{where}.image_url")
                (pictures if split_images else parts).append(image_part(url, part.get("detail")))
            elif kind == "input_image":
                raise Untranslatable(f"`{where}`: chat completions accept images only in user "
                                     "messages", f"{where}.type")
            elif kind in _NO_CHAT_FORM:
                raise Untranslatable(f"`{where}`: content part type {kind!r} has no "
                                     "chat-completions equivalent", f"{where}.type")
            else:
                self.dropped.add("unknown_block")
        return chat_content(parts), pictures
