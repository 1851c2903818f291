"""Byte-level tokenizer and ChatML-like chat template for the mock engine.

Ids 0..255 are the UTF-8 bytes; special tokens follow (see SPECIAL_TOKENS). The template
renders an assistant message (content + tool calls) back to exactly the bytes the engine
generated for it, so a multi-turn prompt always starts with the previous prompt + completion.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

IM_START = 256
IM_END = 257
TOOL_CALL_START = 258
TOOL_CALL_END = 259
# An image in the prompt, as vLLM renders one for a Qwen2-VL-style model: a start token,
# the image's pad token repeated once per vision embedding, an end token. Real models
# repeat the pad a number of times that grows with the image's size; the mock uses a
# fixed count, the same for every image.
VISION_START = 260
IMAGE_PAD = 261
VISION_END = 262
IMAGE_PAD_TOKENS = 16
SPECIAL_TOKENS: dict[str, int] = {
    "<|im_start|>": IM_START,
    "<|im_end|>": IM_END,
    "<tool_call>": TOOL_CALL_START,
    "</tool_call>": TOOL_CALL_END,
    "<|vision_start|>": VISION_START,
    "<|image_pad|>": IMAGE_PAD,
    "<|vision_end|>": VISION_END,
}
VOCAB_SIZE = 263
IMAGE_TEXT = "<|vision_start|>" + "<|image_pad|>" * IMAGE_PAD_TOKENS + "<|vision_end|>"
# The content parts that carry an image: chat's, Responses', Messages'.
IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})
EOS = IM_END

_SPECIAL_BY_ID = {token_id: text for text, token_id in SPECIAL_TOKENS.items()}
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")


def encode(text: str) -> list[int]:
    """Text to ids; special-token strings in the text become their special ids."""
    ids: list[int] = []
    for part in _SPECIAL_RE.split(text):
        special = SPECIAL_TOKENS.get(part)
        if special is not None:
            ids.append(special)
        elif part:
            ids.extend(part.encode("utf-8"))
    return ids


def token_bytes(token_id: int) -> bytes:
    """The raw bytes a token stands for (special tokens: their UTF-8 string)."""
    if 0 <= token_id < 256:
        return bytes((token_id,))
    special = _SPECIAL_BY_ID.get(token_id)
    if special is None:
        raise ValueError(f"token id {token_id} is outside the vocabulary (0..{VOCAB_SIZE - 1})")
    return special.encode("utf-8")


def token_str(token_id: int) -> str:
    """Display string of one token: a byte that is not valid UTF-8 alone renders as U+FFFD."""
    return token_bytes(token_id).decode("utf-8", errors="replace")


def decode(ids: Iterable[int]) -> str:
    """Ids to text; special tokens render as their strings."""
    return b"".join(token_bytes(i) for i in ids).decode("utf-8", errors="replace")


def canonical_json(value: Any) -> str:
    """The one JSON spelling used for generated tool arguments and the tools header."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def tool_call_parts(name: str, arguments: str) -> tuple[str, str, str]:
    """(head, arguments, tail) of a tool call; ``arguments`` is kept verbatim."""
    head = f'<tool_call>{{"name":{json.dumps(name, ensure_ascii=False)},"arguments":'
    return head, arguments, "}</tool_call>"


def render_tool_call(name: str, arguments: str) -> str:
    return "".join(tool_call_parts(name, arguments))


def part_text(part: Any) -> str:
    """A content part as the template renders it: its text, or an image's placeholder."""
    if not isinstance(part, Mapping):
        return ""
    if part.get("type") in IMAGE_PARTS:
        return IMAGE_TEXT
    text = part.get("text")
    return text if isinstance(text, str) else ""


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # content parts: text, and images as placeholders
        return "".join(map(part_text, content))
    return str(content)


def render_message(message: Mapping[str, Any]) -> str:
    text = _content_text(message.get("content"))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):  # some harnesses send the object, not the string
            arguments = canonical_json(arguments)
        text += render_tool_call(str(function.get("name", "")), arguments)
    return f"<|im_start|>{message.get('role', 'user')}\n{text}<|im_end|>\n"


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """ChatML: an optional tools block, one block per message, then the generation prompt."""
    out = [f"<|im_start|>tools\n{canonical_json(list(tools))}<|im_end|>\n"] if tools else []
    out.extend(render_message(m) for m in messages)
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def apply_chat_template(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    return encode(render_chat(messages, tools, add_generation_prompt))
