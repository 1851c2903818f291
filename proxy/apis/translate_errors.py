"""Errors of translation: a request with no chat equivalent, and an upstream's error body.

The bodies the client gets are written by its API's ``errors`` module."""

from __future__ import annotations

from typing import Any

import msgspec

from tracetap.proxy.http.errors import ProxyError

_MAX_MESSAGE_CHARS = 2000


class Untranslatable(Exception):
    """A request that has no faithful chat-completions equivalent; answered with a 400.

    ``param`` names the offending part of the client's request (``tools[2].type``).
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def refusal(self, api: str) -> ProxyError:
        """The 400 the client gets, ``api`` naming its API in the message."""
        return ProxyError(400, f"cannot translate this {api} request to chat completions: "
                          f"{self.message}", "invalid_request_error", "unsupported_parameter",
                          param=self.param)


class UpstreamError(msgspec.Struct, frozen=True):
    """What an upstream error body says, whatever its shape."""

    message: str
    type: str | None = None
    code: str | None = None
    param: str | None = None


def read_upstream_error(status: int, body: bytes) -> UpstreamError:
    """OpenAI's ``{"error": {...}}``, vLLM's flat ``{"message": ...}``, FastAPI's
    ``{"detail": ...}`` or plain text; never raises."""
    try:
        data: Any = msgspec.json.decode(body)
    except (msgspec.DecodeError, TypeError):
        data = None
    if isinstance(data, dict):
        error = data.get("error")
        fields = error if isinstance(error, dict) else data
        message = fields.get("message")
        if message is None and isinstance(error, str):
            message = error
        if message is None and "detail" in data:
            message = data["detail"]
        if message is not None:
            return UpstreamError(
                message=_text(message),
                type=_optional_text(fields.get("type")),
                code=_optional_text(fields.get("code")),
                param=_optional_text(fields.get("param")),
            )
    text = body.decode("utf-8", errors="replace").strip() if isinstance(body, bytes) else ""
    return UpstreamError(message=text[:_MAX_MESSAGE_CHARS] or f"upstream error (HTTP {status})")


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value[:_MAX_MESSAGE_CHARS]
    return msgspec.json.encode(value).decode()[:_MAX_MESSAGE_CHARS]


def _optional_text(value: Any) -> str | None:
    if value is None or isinstance(value, (dict, list)):
        return None
    return value if isinstance(value, str) else str(value)
