"""The error every failure the proxy itself answers raises, in no API's shape yet.

The body is written by the client's API (``proxy/apis/<api>/errors.py``: OpenAI's shape
for chat, completions and Responses, Anthropic's for Messages), chosen once per request
from its route (``proxy.apis.routing.client_errors``): a ``ProxyError`` only says what went
wrong.
"""

from __future__ import annotations

from typing import Protocol

from aiohttp import web

# A refused call's stored status (``calls.status``), by the error's code; any other
# code is stored as "bad_request".
STORED_STATUS = {
    "upstream_timeout": "upstream_timeout",
    "upstream_unreachable": "upstream_unreachable",
    "upstream_error": "upstream_error",
    "paused": "paused",
    "overlay_failed": "overlay_failed",
    "episode_budget_exceeded": "budget_exceeded",
    "episode_budget_reserved": "budget_exceeded",
}


class ProxyError(Exception):
    """A refusal or failure answered to the client with ``status`` and an error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type  # OpenAI's error type; Anthropic's shape derives its own from status
        self.code = code
        self.headers = headers
        self.param = param  # the offending part of the request, where one is named

    def response(self, errors: ErrorShape) -> web.Response:
        """The error in the client's API shape."""
        return web.Response(
            status=self.status,
            body=errors.body(self),
            content_type="application/json",
            headers=self.headers,
        )


class ErrorShape(Protocol):
    """One client API's error body: the one place its shape is decided."""

    def body(self, error: ProxyError) -> bytes:
        """A refusal or failure of the proxy's own."""
        ...

    def from_upstream(self, status: int, body: bytes) -> bytes:
        """An upstream's error body of any shape (a translated call's chat upstream);
        never raises."""
        ...


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
