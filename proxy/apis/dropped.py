"""What a translation to chat left out: request fields the engine cannot use, by name.

Translation is tolerant (docs/translation.md): a field or block with no chat equivalent
is dropped, never a 400, and every drop is noted here. The names are a fixed, small set
so the metric ``tracetap_translation_dropped_total{api,field}`` keeps a low cardinality;
anything not in the set is counted as ``other``. The stored call keeps the counts
(``calls.translation_dropped``).
"""

from __future__ import annotations

import msgspec

FIELDS = frozenset({
    # both APIs
    "cache_control",  # Anthropic prompt-caching hints (the engine caches by itself)
    "metadata",  # client-side tags
    "service_tier",
    "effort",  # an effort level the engine has no option for
    "thinking",  # a thinking budget or mode the engine has no option for
    "encrypted_reasoning",  # redacted_thinking, encrypted_content, thinking signatures
    "hosted_tool",  # a tool the provider runs or defines (web search, bash_2025…)
    "unknown_block",  # a content block / part / input item of a type chat cannot carry
    "tool_choice",  # a tool_choice naming a dropped tool
    # Messages
    "context_management",
    "citations",
    "is_error",  # tool_result.is_error: the text stays, the flag has no chat field
    "deferred_tool",  # a tool with defer_loading: hidden until tool search loads it
    # Responses
    "reasoning_summary",
    "include",
    "store",
    "truncation",
    "prompt_cache_key",
    "safety_identifier",
    "verbosity",
    "max_tool_calls",
    "stream_options",
    "other",
})


class Dropped:
    """The fields one translation dropped, with how often (one owner: the translation of
    one request)."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, field: str, n: int = 1) -> None:
        name = field if field in FIELDS else "other"
        self.counts[name] = self.counts.get(name, 0) + n

    def __bool__(self) -> bool:
        return bool(self.counts)

    def encoded(self) -> str | None:
        """The counts as stored on the call (JSON, sorted), or None when nothing dropped."""
        if not self.counts:
            return None
        return msgspec.json.encode(dict(sorted(self.counts.items()))).decode()


def drop_unknown(obj: dict, known: frozenset[str] | set[str], dropped: Dropped,
                 names: dict[str, str] | None = None) -> None:
    """Count the keys of ``obj`` that translation does not read (``names`` maps a known
    key to its field name in FIELDS; anything else counts as ``other``)."""
    for key in obj:
        if key not in known and obj[key] is not None:
            dropped.add((names or {}).get(key, key))
