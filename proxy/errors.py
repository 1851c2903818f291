"""The one OpenAI-style error shape every failure the proxy itself answers uses."""

from __future__ import annotations

import msgspec
from aiohttp import web


class ProxyError(Exception):
    """An error answered to the client as ``{"error": {message, type, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.headers = headers

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.type, "param": None, "code": self.code}
        return msgspec.json.encode({"error": error})

    def anthropic_body(self) -> bytes:
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error")
        return msgspec.json.encode({"type": "error",
                                    "error": {"type": kind, "message": self.message}})

    def response(self, anthropic: bool = False) -> web.Response:
        """The error in the client's API shape: OpenAI's, or Anthropic's for Messages."""
        return web.Response(
            status=self.status,
            body=self.anthropic_body() if anthropic else self.body(),
            content_type="application/json",
            headers=self.headers,
        )


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 529: "overloaded_error"}


def speaks_anthropic(path: str, headers) -> bool:
    """Whether the client uses Anthropic's API, whose SDKs read only their error shape."""
    return "/messages" in path or "anthropic-version" in headers


def bad_request(message: str, code: str = "invalid_request") -> ProxyError:
    return ProxyError(400, message, "invalid_request_error", code)


def unauthorized(message: str) -> ProxyError:
    return ProxyError(401, message, "authentication_error", "invalid_api_key")


def forbidden(message: str, code: str = "forbidden") -> ProxyError:
    return ProxyError(403, message, "permission_error", code)


def not_found(message: str) -> ProxyError:
    return ProxyError(404, message, "invalid_request_error", "not_found")


def too_large(limit: int) -> ProxyError:
    return ProxyError(
        413, f"request body exceeds the proxy's limit of {limit} bytes", "invalid_request_error",
        "request_too_large",
    )


def upstream_unreachable(detail: str) -> ProxyError:
    return ProxyError(
        502, f"upstream unreachable: {detail}", "upstream_error", "upstream_unreachable"
    )


def upstream_timeout(seconds: float) -> ProxyError:
    return ProxyError(
        504, f"upstream did not answer within {seconds:g}s", "upstream_error", "upstream_timeout"
    )
