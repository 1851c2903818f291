"""The mock engine's tokenizer and info endpoints, per flavor (docs/mock-engine.md)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from tracetap.demo import tokenizer as tok
from tracetap.demo.engine_common import CONFIG, ApiError
from tracetap.demo.engine_common import json_response as _json
from tracetap.demo.wire import LLAMA_SERVER

VLLM_VERSION = "0.11.0"


async def models(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    if config.flavor == "llama-cpp-python":
        card = {"id": config.model, "object": "model", "owned_by": "me", "permissions": []}
        return _json({"object": "list", "data": [card]})
    owner = "llamacpp" if config.flavor in LLAMA_SERVER else config.flavor
    card = {"id": config.model, "object": "model", "created": int(time.time()), "owned_by": owner}
    if config.flavor == "vllm":
        card |= {"root": config.model, "parent": None, "max_model_len": config.max_model_len}
    return _json({"object": "list", "data": [card]})


async def version(request: web.Request) -> web.Response:
    return _json({"version": VLLM_VERSION})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _object(request: web.Request) -> dict[str, Any]:
    try:
        return msgspec.json.decode(await request.read(), type=dict[str, Any])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ApiError(400, f"Invalid JSON body: {exc}") from None


object_body = _object  # the sglang flavor's endpoints read bodies the same way


def _tokens(body: dict[str, Any]) -> list[int]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise ApiError(400, "detokenize needs a tokens list of ids")
    if any(not 0 <= t < tok.VOCAB_SIZE for t in tokens):
        raise ApiError(400, f"token ids must be in [0, {tok.VOCAB_SIZE})", "tokens")
    return tokens


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: a prompt string or a chat (rendered like the chat endpoint)."""
    config = request.app[CONFIG]
    body = await _object(request)
    if isinstance(body.get("messages"), list):
        gen = body.get("add_generation_prompt", True)
        ids = tok.apply_chat_template(body["messages"], body.get("tools"), gen)
    elif isinstance(body.get("prompt"), str):
        ids = tok.encode(body["prompt"])
    else:
        raise ApiError(400, "tokenize needs a prompt string or a messages list")
    strs = [tok.token_str(t) for t in ids] if body.get("return_token_strs") else None
    body = {"count": len(ids), "max_model_len": config.max_model_len, "tokens": ids}
    return _json(body | {"token_strs": strs})


async def detokenize(request: web.Request) -> web.Response:
    return _json({"prompt": tok.decode(_tokens(await _object(request)))})


def _piece(token_id: int) -> str | list[int]:
    """llama-server's piece: the text, or the bytes when they are not valid UTF-8 alone."""
    raw = tok.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


async def llama_tokenize(request: web.Request) -> web.Response:
    """llama-server's /tokenize: ``content``; ``parse_special`` (default true) reads
    special-token strings as special tokens; ``with_pieces`` pairs each id with its piece.
    (``add_special`` would add BOS: the byte vocabulary has none.)"""
    body = await _object(request)
    content = body.get("content")
    if not isinstance(content, str):
        raise ApiError(400, "tokenize needs a content string", "content")
    ids = tok.encode(content) if body.get("parse_special", True) else list(content.encode())
    if body.get("with_pieces"):
        return _json({"tokens": [{"id": t, "piece": _piece(t)} for t in ids]})
    return _json({"tokens": ids})


async def llama_detokenize(request: web.Request) -> web.Response:
    return _json({"content": tok.decode(_tokens(await _object(request)))})


async def apply_template(request: web.Request) -> web.Response:
    """llama-server's /apply-template: the chat request's prompt text, as it would render."""
    body = await _object(request)
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise ApiError(400, "messages must contain at least one message", "messages")
    return _json({"prompt": tok.render_chat(body["messages"], body.get("tools"))})


async def extras_tokenize(request: web.Request) -> web.Response:
    """llama-cpp-python's /extras/tokenize: ``input`` with special tokens parsed."""
    body = await _object(request)
    if not isinstance(body.get("input"), str):
        raise ApiError(400, "tokenize needs an input string", "input")
    ids = tok.encode(body["input"])
    if request.path.endswith("/count"):
        return _json({"count": len(ids)})
    return _json({"tokens": ids})


async def extras_detokenize(request: web.Request) -> web.Response:
    """llama-cpp-python's /extras/detokenize: special tokens render as nothing, and text
    that is not valid UTF-8 is a server error (it decodes strictly)."""
    raw = b"".join(tok.token_bytes(t) for t in _tokens(await _object(request)) if t < 256)
    try:
        return _json({"text": raw.decode("utf-8")})
    except UnicodeDecodeError as exc:
        raise ApiError(500, f"'utf-8' codec can't decode: {exc.reason}") from None
