"""Ask the upstream for what capture needs, and take it back out of the reply.

The client must receive the upstream's answer to its own request: anything the proxy
added (logprobs, the usage chunk, engine token ids) is removed before relaying.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tracetap.proxy.apis import Injected
from tracetap.proxy.apis.chat import CHAT
from tracetap.proxy.http.errors import ProxyError, bad_request

TOKEN_ID_FLAVORS = ("vllm", "sglang")
# SGLang (0.5.23, serving_chat.py) refuses ``return_token_ids`` on a chat stream (400) and
# returns chat ids in ``sglext`` instead, streamed or not: ``input_ids`` (the prompt) and
# ``output_ids`` (one list per choice), at the top level of a body or in one chunk with
# ``choices: []`` after the last token. Clients cannot set these (proxy.apis.fields).
SGLEXT_FLAGS = ("return_input_ids_in_sglext", "return_output_ids_in_sglext")
# Fields that put the prompt in the reply as if sampled (completions' and vLLM chat's
# ``echo``; vLLM's ``prompt_logprobs``): refused, so the agent's own text can never come
# back as completion tokens (docs/apis.md).
_PROMPT_ECHOES = ("echo", "prompt_logprobs")
# Counts the proxy reads itself (budgets reserve by the cap; a weight sync's continuation
# sends what is left of it): integers or a 400 now, never a failure mid-stream later.
_COUNTS = ("max_tokens", "max_completion_tokens", "min_tokens", "n")


def prepare(body: dict[str, Any], endpoint: str, flavor: str) -> Injected:
    """Add capture parameters to ``body`` in place; return what was added.

    The proxy, not the client, decides what the engine reports: ids, logprobs and usage
    are asked whatever the request said (``false`` included) and taken out again of the
    client's reply when it did not ask for them itself."""
    _refuse_echo(body)
    for key in _COUNTS:
        count_field(body, key)
    injected = Injected()
    if endpoint == CHAT:
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise bad_request(f"logprobs must be a boolean, got {_kind(logprobs)}",
                              "invalid_logprobs")
        top = count_field(body, "top_logprobs")
        if logprobs is True:
            injected.client_top_logprobs = top
        else:
            body["logprobs"] = True
            body["top_logprobs"] = 0
            injected.logprobs = True
    elif body.get("logprobs") is not None:
        injected.client_top_logprobs = count_field(body, "logprobs")
    else:
        body["logprobs"] = 0
        injected.logprobs = True
    if body.get("stream") is True:
        options = body.get("stream_options")
        if not isinstance(options, dict) or not options.get("include_usage"):
            body["stream_options"] = {**(options if isinstance(options, dict) else {}),
                                      "include_usage": True}
            injected.usage = True
    if flavor == "sglang" and endpoint == CHAT:
        body.update(dict.fromkeys(SGLEXT_FLAGS, True))
        injected.sglext = True
    elif flavor in TOKEN_ID_FLAVORS and body.get("return_token_ids") is not True:
        body["return_token_ids"] = True  # also over the client's false: ids are not optional
        injected.token_ids = True
    return injected


def _refuse_echo(body: dict[str, Any]) -> None:
    """A 400 for a request that asks for its prompt back (set to anything but off)."""
    for key in _PROMPT_ECHOES:
        value = body.get(key)
        if value is not None and value is not False:
            raise ProxyError(400, f"{key} is not supported: the prompt is never returned as "
                             "completion tokens", code="unsupported_parameter", param=key)


def count_field(body: dict[str, Any], key: str) -> int:
    """A non-negative integer field (``top_logprobs``, completions' ``logprobs``): its
    value, 0 when absent, or a clear 400 (never a crash, never a silently fixed value)."""
    value = body.get(key)
    if value is None:
        return 0
    if type(value) is not int or value < 0:
        raise bad_request(f"{key} must be a non-negative integer, got {_kind(value)}",
                          f"invalid_{key}")
    return value


def _kind(value: Any) -> str:
    return repr(value)[:40] if isinstance(value, (int, float, str)) else type(value).__name__


def strip_body(body: bytes, injected: Injected) -> bytes:
    """A non-streaming reply without what the proxy asked for.

    vLLM's whole replies carry ``"prompt_token_ids": null`` (and ``token_ids``) when
    not asked for, so the fields are nulled rather than deleted. Only the top level and
    the choices are decoded; every other value is relayed as the upstream wrote it.
    Raises msgspec errors on malformed JSON (the caller relays those bytes as they are).
    """
    top = _decode_top(body)
    _strip(top, injected, keep_null=True)
    return _encode(top)


def strip_chunk(data: bytes, injected: Injected) -> bytes | None:
    """One stream chunk without the added fields; None drops the chunk altogether."""
    top = _decode_top(data)
    if injected.usage and "usage" in top:
        if bytes(top["usage"]) == b"null":
            del top["usage"]  # chunks carry it only because include_usage was asked for
        elif "choices" not in top or bytes(top["choices"]) == b"[]":
            return None  # the usage chunk the proxy asked for
    # Stream chunks omit unset fields, so here they are deleted.
    had_ext = "sglext" in top
    _strip(top, injected, keep_null=False)
    if had_ext and "sglext" not in top and bytes(top.get("choices", b"")) == b"[]" \
            and bytes(top.get("usage", b"null")) == b"null":
        return None  # SGLang's chunk of the ids (or routing) asked for, and nothing else
    return _encode(top)


_NULL = msgspec.Raw(b"null")
_decode_top = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode_choices = msgspec.json.Decoder(list[dict[str, msgspec.Raw]]).decode
_encode = msgspec.json.encode


def _drop(obj: dict[str, msgspec.Raw], key: str, keep_null: bool) -> None:
    if keep_null:
        if key in obj:
            obj[key] = _NULL
    else:
        obj.pop(key, None)


def _strip(top: dict[str, msgspec.Raw], injected: Injected, keep_null: bool) -> None:
    # Runs once per stream event: the flags are read once (and _drop pops a stream
    # chunk's fields in one C call each).
    token_ids, experts, sglext = injected.token_ids, injected.experts, injected.sglext
    if token_ids:
        _drop(top, "prompt_token_ids", keep_null)
    if experts:
        top.pop("prompt_routed_experts", None)
    if (sglext or experts) and "sglext" in top:
        _strip_sglext(top, sglext, experts)
    if "choices" not in top:
        return
    choices = _decode_choices(top["choices"])
    logprobs = injected.logprobs
    for choice in choices:
        if logprobs and "logprobs" in choice:
            choice["logprobs"] = _NULL
        if token_ids:
            _drop(choice, "token_ids", keep_null)
            _drop(choice, "prompt_token_ids", keep_null)
        elif sglext:  # a continuation's chunks (proxy.call.continuation) carry ids
            choice.pop("token_ids", None)
        if experts:
            choice.pop("routed_experts", None)
    top["choices"] = msgspec.Raw(_encode(choices))


_decode_sglext = msgspec.json.Decoder(dict[str, msgspec.Raw] | None).decode


def _strip_sglext(top: dict[str, msgspec.Raw], ids: bool, experts: bool) -> None:
    """SGLang's ``sglext`` less the ids and the routing the proxy asked for; gone when
    nothing is left (SGLang itself omits an empty one)."""
    ext = _decode_sglext(top["sglext"])
    if ext is not None:
        for key in ("input_ids", "output_ids") if ids else ():
            ext.pop(key, None)
        if experts:
            ext.pop("routed_experts", None)
    if ext:
        top["sglext"] = msgspec.Raw(_encode(ext))
    else:
        del top["sglext"]
