"""OpenAI's error body, the one chat completions, completions and Responses clients read
(and the admin API answers with): ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import msgspec

from tracetap.proxy.apis.translate_errors import read_upstream_error
from tracetap.proxy.http.errors import ProxyError

_encode = msgspec.json.encode


class OpenAIErrors:
    def body(self, error: ProxyError) -> bytes:
        return _encode({"error": {"message": error.message, "type": error.type,
                                  "param": error.param, "code": error.code}})

    def from_upstream(self, status: int, body: bytes) -> bytes:
        """The upstream's type and code kept, else ``invalid_request_error`` (4xx) or
        ``server_error`` (5xx)."""
        error = read_upstream_error(status, body)
        kind = error.type or ("server_error" if status >= 500 else "invalid_request_error")
        return self.body(ProxyError(status, error.message, kind, error.code, param=error.param))


OPENAI_ERRORS = OpenAIErrors()
