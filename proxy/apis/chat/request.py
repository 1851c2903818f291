"""Building a chat-completions request from another API's request: checked field reads
that fail as ``Untranslatable`` naming the parameter, and the one content rule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from tracetap.proxy.apis.translate_errors import Untranslatable

ModelMap = Callable[[str], str]


def as_object(value: Any, param: str | None, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Untranslatable(f"{what} must be a JSON object", param)
    return value


def as_list(value: Any, param: str) -> list[Any]:
    if not isinstance(value, list):
        raise Untranslatable(f"`{param}` must be an array", param)
    return value


def as_str(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise Untranslatable(f"`{param}` must be a string", param)
    return value


def optional_number(request: dict[str, Any], key: str) -> float | int | None:
    value = request.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise Untranslatable(f"`{key}` must be a number", key)
    return value


def optional_int(request: dict[str, Any], key: str) -> int | None:
    value = request.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise Untranslatable(f"`{key}` must be an integer", key)
    return value


def optional_bool(request: dict[str, Any], key: str) -> bool | None:
    value = request.get(key)
    if value is not None and not isinstance(value, bool):
        raise Untranslatable(f"`{key}` must be a boolean", key)
    return value


def mapped_model(request: dict[str, Any], model_map: ModelMap | None) -> str | None:
    """The upstream's model name for the client's (None: let the upstream pick)."""
    model = request.get("model")
    if model is None:
        return None
    model = as_str(model, "model")
    return model_map(model) if model_map is not None else model


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def image_part(url: str, detail: Any = None) -> dict[str, Any]:
    image: dict[str, Any] = {"url": url}
    if isinstance(detail, str):
        image["detail"] = detail
    return {"type": "image_url", "image_url": image}


def chat_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """One text part is sent as a plain string (what a chat harness sends); several
    parts, or any image, stay a list, so the engine joins them as it does for chat."""
    if not parts:
        return ""
    if len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0]["text"]
    return parts


def encode_arguments(value: Any, param: str) -> str:
    """Tool-call arguments as JSON text: compact, keys in the client's order (the spelling
    engines such as llama.cpp emit; vLLM and SGLang re-parse arguments before templating)."""
    try:
        return msgspec.json.encode(value).decode()
    except (TypeError, ValueError, msgspec.EncodeError) as exc:
        raise Untranslatable(f"`{param}` is not JSON: {exc}", param) from None
