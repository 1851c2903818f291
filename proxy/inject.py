"""Ask the upstream for what capture needs, and take it back out of the reply.

The client must receive the upstream's answer to its own request: anything the proxy
added (logprobs, the usage chunk, engine token ids) is removed before relaying.
"""

from __future__ import annotations

from typing import Any

import msgspec

CHAT = "chat.completions"
COMPLETIONS = "completions"
TOKEN_ID_FLAVORS = ("vllm", "sglang")


class Injected(msgspec.Struct, kw_only=True):
    """What the proxy added to one request."""

    logprobs: bool = False
    usage: bool = False
    token_ids: bool = False
    # What the client itself asked for, kept for storage decisions.
    client_top_logprobs: int = 0

    @property
    def any(self) -> bool:
        return self.logprobs or self.usage or self.token_ids


def prepare(body: dict[str, Any], endpoint: str, flavor: str) -> Injected:
    """Add capture parameters to ``body`` in place; return what was added."""
    injected = Injected()
    if endpoint == CHAT:
        if body.get("logprobs") is True:
            injected.client_top_logprobs = int(body.get("top_logprobs") or 0)
        else:
            body["logprobs"] = True
            body["top_logprobs"] = 0
            injected.logprobs = True
    elif body.get("logprobs") is not None:
        injected.client_top_logprobs = int(body.get("logprobs") or 0)
    else:
        body["logprobs"] = 0
        injected.logprobs = True
    if body.get("stream") is True:
        options = body.get("stream_options")
        if not isinstance(options, dict) or not options.get("include_usage"):
            body["stream_options"] = {**(options if isinstance(options, dict) else {}),
                                      "include_usage": True}
            injected.usage = True
    if flavor in TOKEN_ID_FLAVORS and "return_token_ids" not in body:
        body["return_token_ids"] = True
        injected.token_ids = True
    return injected


def strip_body(body: dict[str, Any], injected: Injected) -> None:
    """Remove from a non-streaming reply what the proxy asked for (in place).

    vLLM's whole replies carry ``"prompt_token_ids": null`` (and ``token_ids``) when
    not asked for, so the fields are nulled rather than deleted.
    """
    _strip(body, injected, keep_null=True)


def strip_chunk(chunk: dict[str, Any], injected: Injected) -> bool:
    """Remove added fields from one stream chunk (in place); False drops the chunk."""
    if injected.usage:
        if not chunk.get("choices") and chunk.get("usage") is not None:
            return False
        if "usage" in chunk and chunk["usage"] is None:
            del chunk["usage"]
    # Stream chunks omit unset fields, so here they are deleted.
    _strip(chunk, injected, keep_null=False)
    return True


def _drop(obj: dict[str, Any], key: str, keep_null: bool) -> None:
    if key in obj:
        if keep_null:
            obj[key] = None
        else:
            del obj[key]


def _strip(obj: dict[str, Any], injected: Injected, keep_null: bool) -> None:
    if injected.token_ids:
        _drop(obj, "prompt_token_ids", keep_null)
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if injected.logprobs and "logprobs" in choice:
            choice["logprobs"] = None
        if injected.token_ids:
            _drop(choice, "token_ids", keep_null)
            _drop(choice, "prompt_token_ids", keep_null)
