"""The mock engine's side of a weight sync: continuing an answer from its token ids.

A proxy that cut a stream for a weight sync sends the prompt ids plus the completion ids
sampled so far to ``/v1/completions`` as a token-id prompt. With ``mock_content`` (the
answer is that exact text, one byte token per byte) the mock continues it: when the
prompt ends with the first k tokens of the content, it samples the rest, so the joined
answer is the content token for token, as an uninterrupted call would have been.
"""

from __future__ import annotations

from typing import Any


def remaining(prompt: Any, content: str | None) -> str | None:
    """What is left of ``content`` after the part the token-id ``prompt`` ends with."""
    if content is None or not isinstance(prompt, list) or not prompt:
        return content
    data = content.encode("utf-8")
    if not all(type(t) is int for t in prompt):
        return content
    for k in range(min(len(data), len(prompt)), 0, -1):
        if prompt[-k:] == list(data[:k]):
            return data[k:].decode("utf-8", "replace")
    return content
