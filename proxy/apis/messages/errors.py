"""Anthropic's error body, the one Messages clients (and Anthropic's SDKs) read:
``{"type": "error", "error": {"type", "message"}}``, its type decided by the status
alone, for the proxy's own refusals and a translated call's upstream errors alike."""

from __future__ import annotations

import msgspec

from tracetap.proxy.apis.translate_errors import read_upstream_error
from tracetap.proxy.http.errors import ProxyError

# Anthropic's error types by HTTP status (docs/translation.md, "Upstream errors"): only
# types the SDKs' error models know (413 reads as invalid_request_error there).
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
          403: "permission_error", 404: "not_found_error", 429: "rate_limit_error",
          503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    """Other 4xx read as ``invalid_request_error``, anything else as ``api_error``."""
    return _TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500
                                  else "api_error")


class AnthropicErrors:
    def body(self, error: ProxyError) -> bytes:
        return msgspec.json.encode({"type": "error", "error": {
            "type": error_type(error.status), "message": error.message}})

    def from_upstream(self, status: int, body: bytes) -> bytes:
        return self.body(ProxyError(status, read_upstream_error(status, body).message))


ANTHROPIC_ERRORS = AnthropicErrors()
