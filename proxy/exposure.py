"""What an agent may reach through the proxy: the model API, and nothing else.

The agent is driven by the policy being trained and will try whatever its base URL
reaches: engine control endpoints (weight loading, sleep, cache flush), other methods,
path tricks. So agent traffic is matched against an allowlist, after the raw path has
been checked; anything else is refused here and never forwarded (and so never carries
the proxy's upstream key).
"""

from __future__ import annotations

import re

import msgspec

from tracetap.proxy.errors import ProxyError


class Rule(msgspec.Struct, frozen=True):
    method: str  # an HTTP method, or "*" for any
    path: str  # exact, or a prefix ending in "/*"

    def matches(self, method: str, path: str) -> bool:
        if self.method not in ("*", method):
            return False
        if self.path.endswith("/*"):
            return path.startswith(self.path[:-1]) and len(path) > len(self.path) - 1
        return path == self.path

    def __str__(self) -> str:
        return f"{self.method} {self.path}"


# The model API surface of vLLM, SGLang, llama.cpp and OpenAI-compatible servers, plus
# read-only helpers that change nothing on the engine.
DEFAULT_RULES = (
    Rule("POST", "/v1/chat/completions"),
    Rule("POST", "/v1/completions"),
    Rule("POST", "/v1/responses"),
    Rule("POST", "/v1/messages"),
    Rule("POST", "/v1/messages/count_tokens"),
    Rule("GET", "/v1/models"),
    Rule("GET", "/v1/models/*"),
    Rule("POST", "/tokenize"),
    Rule("POST", "/detokenize"),
)
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")

# Dot segments, empty segments, backslashes and percent-encoded dots, slashes,
# backslashes or NULs: an upstream or an intermediary may resolve any of them into
# another path than the one matched here.
_UNSAFE = re.compile(r"//|\\|%2e|%2f|%5c|%00|(^|/)\.{1,2}(/|$)", re.IGNORECASE)


def parse_rule(text: str) -> Rule:
    """``/path``, ``/prefix/*`` or ``METHOD /path`` (from --allow-path)."""
    parts = text.split()
    if len(parts) == 1:
        method, path = "*", parts[0]
    elif len(parts) == 2:
        method, path = parts[0].upper(), parts[1]
    else:
        raise ValueError(f"--allow-path {text!r}: use '/path', '/prefix/*' or 'METHOD /path'")
    if method != "*" and method not in METHODS:
        raise ValueError(f"--allow-path {text!r}: unknown method {method!r}")
    if not path.startswith("/") or _UNSAFE.search(path) or path.startswith("/tracetap"):
        raise ValueError(f"--allow-path {text!r}: a plain absolute path outside /tracetap")
    return Rule(method, path)


class Exposure:
    """The allowlist in force: the defaults plus the operator's ``--allow-path`` rules."""

    def __init__(self, extra: list[str] | tuple[str, ...] = ()):
        self.rules = (*DEFAULT_RULES, *(parse_rule(t) for t in extra))

    def allows(self, method: str, path: str) -> bool:
        return any(rule.matches(method, path) for rule in self.rules)

    def describe(self) -> str:
        return ", ".join(str(rule) for rule in self.rules)


def check_raw_path(raw_path: str) -> None:
    """Refuse paths that could be resolved into another path further along."""
    path = raw_path.split("?", 1)[0]
    if _UNSAFE.search(path):
        raise ProxyError(400, "invalid request path: dot segments, empty segments and "
                         "encoded dots or slashes are not accepted", "invalid_request_error",
                         "invalid_path")


def refused(method: str, path: str) -> ProxyError:
    return ProxyError(404, f"{method} {path} is not exposed by this proxy: agents reach only "
                      "the model API (the operator can allow more with --allow-path)",
                      "invalid_request_error", "not_exposed")
