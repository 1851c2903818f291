"""What an agent may reach through the proxy: the model API, and nothing else.

The agent is driven by the policy being trained and will try whatever its base URL
reaches: engine control endpoints (weight loading, sleep, cache flush), other methods,
path tricks. So the raw path is decoded to a fixed point and checked (``checked_path``),
agent traffic is matched against an allowlist on exactly that path, and the upstream is
sent exactly that path, encoded once (``upstream_path``): nothing further along decodes
or resolves it into another one. Anything else is refused here and never forwarded (and
so never carries the proxy's upstream key).
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

import msgspec

from tracetap.proxy.http.errors import ProxyError


class Rule(msgspec.Struct, frozen=True):
    method: str  # an HTTP method, or "*" for any
    path: str  # exact, or a prefix ending in "/*"

    @property
    def prefix(self) -> bool:
        return self.path.endswith("/*")

    def matches(self, method: str, path: str) -> bool:
        if self.method not in ("*", method):
            return False
        if self.prefix:
            return path.startswith(self.path[:-1]) and len(path) > len(self.path) - 1
        return path == self.path

    def __str__(self) -> str:
        return f"{self.method} {self.path}"


# Besides the model APIs' own paths (each API's, from ``apis/registry.py``, given by
# whoever builds the allowlist): read-only helpers of vLLM, SGLang, llama.cpp and
# OpenAI-compatible servers that change nothing on the engine.
DEFAULT_RULES = (
    Rule("GET", "/v1/models"),
    Rule("GET", "/v1/models/*"),
    Rule("POST", "/tokenize"),
    Rule("POST", "/detokenize"),
)
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")

# Engine control endpoints of vLLM and SGLang (weights, sleep and memory, caches, LoRA,
# profiling, aborts, sessions, internal state): reachable only through a rule that names
# the path exactly, never through a prefix rule such as "/*" or "/v1/*". A path is one
# when any of its segments is one of these names (or of the families below).
CONTROL_NAMES = frozenset({
    # vLLM
    "sleep", "wake_up", "is_sleeping", "collective_rpc", "reset_prefix_cache",
    "reset_mm_cache", "reset_encoder_cache", "load_lora_adapter", "unload_lora_adapter",
    "start_profile", "stop_profile", "scale_elastic_ep", "is_scaling_elastic_ep",
    "server_info", "pause", "resume", "is_paused", "update_weights",
    "init_weight_transfer_engine", "get_world_size", "abort_requests",
    # SGLang
    "flush_cache", "get_weights_by_name", "update_weight_version",
    "release_memory_occupation", "resume_memory_occupation", "slow_down",
    "abort_request", "pause_generation", "continue_generation", "configure_logging",
    "set_internal_state", "get_internal_state", "get_server_info", "get_server_args",
    "get_model_info", "get_load", "get_memory_pool_size", "open_session", "close_session",
    "freeze_gc", "clear_hicache_storage_backend", "start_expert_distribution_record",
    "stop_expert_distribution_record", "dump_expert_distribution_record",
})
CONTROL_FAMILIES = re.compile(
    r"(update|init|destroy|send|get)_weights?_.*|.*_weights_.*|.*lora_adapter.*"
    r"|.*_profile|.*_memory_occupation|.*expert_distribution.*|.*_elastic_ep"
)

# What may remain in a path once it is decoded: the unreserved and sub-delimiter
# characters of RFC 3986 less ";" (path parameters, which some servers strip: "/..;/"),
# plus "/", ":" and "@". No backslash, space, control character, "?" or "#", and nothing
# outside ASCII (fullwidth dots and the like, which a normalising server reads as ".").
_PLAIN = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,=:@/%]*")
# Dot segments, empty segments, and (in the raw path) encoded dots, slashes, backslashes
# or NULs: an upstream or an intermediary may resolve any of them into another path.
_UNSAFE = re.compile(r"//|\\|%2e|%2f|%5c|%00|(^|/)\.{1,2}(/|$)", re.IGNORECASE)
# Characters sent as they are in the upstream path; everything else is percent-encoded.
_PATH_SAFE = "/-._~!$&'()*+,=:@"


def is_control(path: str) -> bool:
    return any(seg.lower() in CONTROL_NAMES or CONTROL_FAMILIES.fullmatch(seg.lower())
               for seg in path.split("/"))


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
    plain = path[:-1] if path.endswith("/*") else path
    if (not path.startswith("/") or _UNSAFE.search(path) or path.startswith("/tracetap")
            or not _PLAIN.fullmatch(plain) or "%" in plain):
        raise ValueError(f"--allow-path {text!r}: a plain absolute path outside /tracetap")
    return Rule(method, path)


class Exposure:
    """The allowlist in force: the model APIs' paths (POST), the defaults, and the
    operator's ``--allow-path`` rules."""

    def __init__(self, extra: list[str] | tuple[str, ...] = (),
                 model_paths: tuple[str, ...] = ()):
        self.rules = (*(Rule("POST", path) for path in model_paths), *DEFAULT_RULES,
                      *(parse_rule(t) for t in extra))

    def allows(self, method: str, path: str) -> bool:
        """``path`` as ``checked_path`` returned it (less any episode prefix)."""
        control = is_control(path)
        return any(rule.matches(method, path) and not (control and rule.prefix)
                   for rule in self.rules)

    def describe(self) -> str:
        return ", ".join(str(rule) for rule in self.rules)


def checked_path(raw_path: str) -> str:
    """The path as the proxy checks, allows and forwards it: ``raw_path`` (as it came on
    the wire) percent-decoded once. Refused when decoding again would change it (an
    encoded escape such as ``%252e``, at any depth), or when it holds dot or empty
    segments, encoded dots or slashes, or characters outside ``_PLAIN``."""
    raw = raw_path.split("?", 1)[0]
    try:
        path = unquote(raw, errors="strict")
        deeper = path
        while True:  # each pass that changes the text shortens it: this ends
            decoded = unquote(deeper, errors="strict")
            if decoded == deeper:
                break
            deeper = decoded
    except UnicodeDecodeError:
        raise _invalid("percent-encoded bytes that are not UTF-8") from None
    if deeper != path:
        raise _invalid("percent-encoding inside percent-encoding")
    if _UNSAFE.search(raw) or _UNSAFE.search(path) or not _PLAIN.fullmatch(path):
        raise _invalid("dot segments, empty segments, encoded dots or slashes, and "
                       "characters outside plain ASCII are not accepted")
    return path


def upstream_path(path: str, raw_query: str) -> str:
    """The checked path encoded once, and the query as it came (re-encoded where it held
    characters a URL cannot carry), for a URL that nothing decodes or resolves again."""
    target = quote(path, safe=_PATH_SAFE)
    if raw_query:
        target += "?" + quote(raw_query, safe=_PATH_SAFE + "%?;")
    return target


def _invalid(why: str) -> ProxyError:
    return ProxyError(400, f"invalid request path: {why}", "invalid_request_error",
                      "invalid_path")


def refused(method: str, path: str) -> ProxyError:
    return ProxyError(404, f"{method} {path} is not exposed by this proxy: agents reach only "
                      "the model API (the operator can allow more with --allow-path)",
                      "invalid_request_error", "not_exposed")
