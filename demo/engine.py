"""HTTP side of the mock engine: vLLM-like endpoints, streaming and fault injection.

Endpoints by flavor. ``vllm`` serves everything a vLLM server does here: chat and legacy
completions, the OpenAI Responses API (``/v1/responses``) and the Anthropic Messages API
(``/v1/messages`` and ``/v1/messages/count_tokens``, any query string such as
``?beta=true``), plus ``/tokenize``, ``/detokenize`` and ``/version``. ``openai`` serves
what OpenAI's API does: chat, completions and Responses (no Messages: 404), and rejects
vLLM-only fields such as ``return_token_ids`` or ``enable_response_messages``.
``llama-server`` (old name ``llamacpp``) is llama.cpp's C++ server: chat and completions
with token ids only inside logprob entries, ``/apply-template``, ``/tokenize`` and
``/detokenize`` in its own shapes; ``/v1/responses`` and ``/v1/messages`` answer 404, which
is what a translating proxy has to handle. ``llama-cpp-python`` is the Python server: chat
and completions with no token ids anywhere (logprobs carry token strings, null bytes, and
only when ``top_logprobs`` is set), no usage in streams, and ``/extras/tokenize``,
``/extras/tokenize/count`` and ``/extras/detokenize`` as its only tokenizer endpoints.
Like the real server (``--interrupt_requests``, on by default), it ends a stream with
``[DONE]`` as soon as any other request arrives while it streams.

Responses and Messages requests are rendered as the equivalent chat conversation first
(see demo/responses.py and demo/messages.py), so they get the same prompt ids, tokens and
logprobs as that chat request. Their streams are named SSE events (``event:`` + ``data:``)
with no ``[DONE]``; their errors use their own API's shape.

Per-request fault injection (extra body fields, accepted by every flavor and endpoint):
``mock_delay_s``, ``mock_chunk_delay_s``, ``mock_fail_after_chunks`` (events, for named
streams), ``mock_status``, ``mock_completion_tokens``, ``mock_garbage``, ``mock_tool_rounds``,
``mock_content``, ``mock_bad_tool_args``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from tracetap.demo import messages, responses, sending
from tracetap.demo import tokenizer as tok
from tracetap.demo.generate import (
    TOP_LOGPROBS_MAX,
    Completion,
    Sampling,
    generate_chat,
    generate_text,
)
from tracetap.demo.wire import (
    FLAVORS,
    LLAMA_SERVER,
    OPENAI_FIELDS,
    ChatRequest,
    ChatTurn,
    CompletionRequest,
    EngineRequest,
    Flavor,
    InputError,
    Shape,
    chat_body,
    chat_chunks,
    completion_body,
    completion_chunks,
    error_body,
)

VLLM_VERSION = "0.11.0"


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True):
    flavor: Flavor = "vllm"
    model: str = "mock-model"
    max_tokens_default: int = 256  # byte-level tool calls are ~50 tokens: keep headroom
    tool_rounds: int = 2
    chunk_delay_s: float = 0.0
    max_model_len: int = 32768
    bad_tool_args: float = 0.0  # seeded failure mode: this fraction of tool calls is invalid
    tool_preface: float = 0.5  # the share of tool calls with a sentence before them

    def __post_init__(self) -> None:
        if not 0.0 <= self.bad_tool_args <= 1.0:
            raise ValueError("bad_tool_args is a fraction in [0, 1]")
        if not 0.0 <= self.tool_preface <= 1.0:
            raise ValueError("tool_preface is a fraction in [0, 1]")
        if self.flavor not in FLAVORS:
            raise ValueError(f"unknown engine flavor {self.flavor!r}")


CONFIG = web.AppKey("engine_config", EngineConfig)


class Arrivals:
    """Requests received so far: a llama-cpp-python stream ends when another arrives."""

    def __init__(self) -> None:
        self.count = 0

    def interrupter(self, flavor: str):
        if flavor != "llama-cpp-python":
            return None
        start = self.count
        return lambda: self.count != start


ARRIVALS = web.AppKey("arrivals", Arrivals)


@web.middleware
async def _count_arrivals(request: web.Request, handler: Any) -> web.StreamResponse:
    request.app[ARRIVALS].count += 1
    return await handler(request)
_OPENAI_FIELDS = OPENAI_FIELDS | {responses.ResponsesRequest: responses.OPENAI_FIELDS}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _json(body: Any, status: int = 200) -> web.Response:
    data = msgspec.json.encode(body)
    return web.Response(body=data, status=status, content_type="application/json")


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except InputError as exc:
        error = ApiError(400, str(exc), exc.param)
    except ApiError as exc:
        error = exc
    if request.path.startswith("/v1/messages"):
        return _json(messages.error_body(error.status, error.message), error.status)
    body = error_body(request.app[CONFIG].flavor, error.status, error.message, error.param)
    return _json(body, error.status)


async def _parse(request: web.Request, kind: type[EngineRequest]) -> Any:
    """Decode and check the body, then apply ``mock_delay_s`` and ``mock_status``."""
    try:
        raw = msgspec.json.decode(await request.read())
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"Invalid JSON body: {exc}") from None
    if not isinstance(raw, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    if request.app[CONFIG].flavor == "openai":
        for key in raw:
            if key not in _OPENAI_FIELDS[kind] and not key.startswith("mock_"):
                raise ApiError(400, f"Unrecognized request argument supplied: {key}")
    try:
        req = msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        raise ApiError(400, str(exc)) from None
    if req.mock_delay_s > 0:
        await asyncio.sleep(req.mock_delay_s)
    if req.mock_status is not None:
        if not 400 <= req.mock_status <= 599:
            raise ApiError(400, "mock_status must be between 400 and 599", "mock_status")
        raise ApiError(req.mock_status, f"Injected failure (mock_status={req.mock_status})")
    return req


def _sampling(
    req: EngineRequest, max_tokens: int | None, default: int, stop: Any = None,
    bad_tool_args: float = 0.0,
) -> Sampling:
    max_tokens = default if max_tokens is None else max_tokens
    stop = req.stop if stop is None else stop
    for value, param in (
        (max_tokens, "max_tokens"),
        (req.n, "n"),
        (req.mock_completion_tokens, "mock_completion_tokens"),
    ):
        if value is not None and value < 1:
            raise ApiError(400, f"{param} must be at least 1, got {value}", param)
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    bad = bad_tool_args if req.mock_bad_tool_args is None else req.mock_bad_tool_args
    if not 0.0 <= bad <= 1.0:
        raise ApiError(400, "mock_bad_tool_args is a fraction in [0, 1]", "mock_bad_tool_args")
    return Sampling(max_tokens, req.seed or 0, stop, req.mock_completion_tokens,
                    req.mock_content, bad)


def _shape(
    request: web.Request, req: EngineRequest, prefix: str, top_k: int | None, param: str
) -> Shape:
    config = request.app[CONFIG]
    if top_k is not None and not 0 <= top_k <= TOP_LOGPROBS_MAX:
        raise ApiError(400, f"{param} must be between 0 and {TOP_LOGPROBS_MAX}", param)
    rid = prefix + uuid.uuid4().hex
    return Shape(config.flavor, req, req.model or config.model, rid, int(time.time()), top_k)


def _complete(
    request: web.Request, req: EngineRequest, turn: ChatTurn, sampling: Sampling, n: int = 1
) -> tuple[list[int], list[Completion]]:
    """Render the chat turn and generate ``n`` choices: the one path every chat-like API uses."""
    config = request.app[CONFIG]
    rounds = config.tool_rounds if req.mock_tool_rounds is None else req.mock_tool_rounds
    prompt_ids = tok.apply_chat_template(turn.messages, turn.tools)
    return prompt_ids, [
        generate_chat(prompt_ids, turn.messages, turn.tools, turn.tool_choice, i, sampling, rounds,
                      preface=config.tool_preface)
        for i in range(n)
    ]


async def chat_completions(request: web.Request) -> web.StreamResponse:
    config = request.app[CONFIG]
    req: ChatRequest = await _parse(request, ChatRequest)
    if not req.messages:
        raise ApiError(400, "messages must contain at least one message", "messages")
    max_tokens = req.max_completion_tokens or req.max_tokens
    sampling = _sampling(req, max_tokens, config.max_tokens_default,
                         bad_tool_args=config.bad_tool_args)
    top_k = (req.top_logprobs or 0) if req.logprobs else None
    if config.flavor == "llama-cpp-python" and req.top_logprobs is None:
        top_k = None  # it asks for logprobs with top_logprobs only
    shape = _shape(request, req, "chatcmpl-", top_k, "top_logprobs")
    turn = ChatTurn(req.messages, req.tools, req.tool_choice)
    prompt_ids, completions = _complete(request, req, turn, sampling, req.n or 1)
    if req.stream:
        chunks = chat_chunks(shape, prompt_ids, completions)
        return await sending.send_stream(request, req, chunks, config.chunk_delay_s,
                                         interrupted=_interrupter(request))
    return await sending.send_body(request, req, chat_body(shape, prompt_ids, completions))


def _interrupter(request: web.Request):
    return request.app[ARRIVALS].interrupter(request.app[CONFIG].flavor)


def _prompts(prompt: Any) -> list[list[int]]:
    """A string, a list of ids, or a batch (list) of either."""
    if isinstance(prompt, str):
        return [tok.encode(prompt)]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        batch = [prompt]
    elif isinstance(prompt, list) and prompt:
        batch = [tok.encode(p) if isinstance(p, str) else p for p in prompt]
    else:
        raise ApiError(400, "prompt must be a string, a list of token ids, or a batch", "prompt")
    for ids in batch:
        if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
            raise ApiError(400, "prompt must be a string, a list of token ids, or a batch")
        if any(not 0 <= t < tok.VOCAB_SIZE for t in ids):
            raise ApiError(400, f"token ids must be in [0, {tok.VOCAB_SIZE})", "prompt")
    return batch


async def completions(request: web.Request) -> web.StreamResponse:
    config = request.app[CONFIG]
    req: CompletionRequest = await _parse(request, CompletionRequest)
    sampling = _sampling(req, req.max_tokens, config.max_tokens_default)
    shape = _shape(request, req, "cmpl-", req.logprobs, "logprobs")
    batch = _prompts(req.prompt)
    results = [(p, generate_text(p, j, sampling)) for p in batch for j in range(req.n or 1)]
    prompt_tokens = sum(len(p) for p in batch)
    if req.stream:
        chunks = completion_chunks(shape, results, prompt_tokens)
        return await sending.send_stream(request, req, chunks, config.chunk_delay_s,
                                         interrupted=_interrupter(request))
    return await sending.send_body(request, req, completion_body(shape, results, prompt_tokens))


async def create_response(request: web.Request) -> web.StreamResponse:
    config = request.app[CONFIG]
    req: responses.ResponsesRequest = await _parse(request, responses.ResponsesRequest)
    sampling = _sampling(req, req.max_output_tokens, config.max_tokens_default,
                         bad_tool_args=config.bad_tool_args)
    shape = _shape(request, req, "resp_", responses.top_k(req), "top_logprobs")
    prompt_ids, (c,) = _complete(request, req, responses.to_chat(req), sampling)
    body = responses.response_body(shape, prompt_ids, c, sampling.max_tokens)
    if req.stream:
        events = responses.response_events(shape, body, c)
        return await sending.send_stream(request, req, events, config.chunk_delay_s, named=True)
    return await sending.send_body(request, req, body)


async def create_message(request: web.Request) -> web.StreamResponse:
    config = request.app[CONFIG]
    req: messages.MessagesRequest = await _parse(request, messages.MessagesRequest)
    if req.max_tokens is None:
        raise ApiError(400, "max_tokens: Field required", "max_tokens")
    sampling = _sampling(req, req.max_tokens, config.max_tokens_default, req.stop_sequences,
                         bad_tool_args=config.bad_tool_args)
    shape = _shape(request, req, "chatcmpl-", None, "")
    prompt_ids, (c,) = _complete(request, req, messages.to_chat(req), sampling)
    if req.stream:
        events = messages.message_events(shape, prompt_ids, c)
        return await sending.send_stream(request, req, events, config.chunk_delay_s, named=True)
    return await sending.send_body(request, req, messages.message_body(shape, prompt_ids, c))


async def count_tokens(request: web.Request) -> web.Response:
    turn = messages.to_chat(await _parse(request, messages.MessagesRequest))
    count = len(tok.apply_chat_template(turn.messages, turn.tools))
    return _json({"input_tokens": count, "context_management": {"original_input_tokens": count}})


# ---- other endpoints ---------------------------------------------------------------------


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


def make_engine_app(config: EngineConfig | None = None) -> web.Application:
    config = config or EngineConfig()
    app = web.Application(middlewares=[_count_arrivals, _errors],
                          client_max_size=64 * 1024 * 1024)
    app[CONFIG] = config
    app[ARRIVALS] = Arrivals()
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    if config.flavor in ("vllm", "openai"):
        app.router.add_post("/v1/responses", create_response)
    if config.flavor == "vllm":
        app.router.add_post("/v1/messages", create_message)
        app.router.add_post("/v1/messages/count_tokens", count_tokens)
        app.router.add_get("/version", version)
        app.router.add_post("/tokenize", tokenize)
        app.router.add_post("/detokenize", detokenize)
    if config.flavor in LLAMA_SERVER:
        app.router.add_post("/tokenize", llama_tokenize)
        app.router.add_post("/detokenize", llama_detokenize)
        app.router.add_post("/apply-template", apply_template)
    if config.flavor == "llama-cpp-python":
        app.router.add_post("/extras/tokenize", extras_tokenize)
        app.router.add_post("/extras/tokenize/count", extras_tokenize)
        app.router.add_post("/extras/detokenize", extras_detokenize)
    return app


class EngineServer:
    """Runs the engine inside the current event loop: ``async with EngineServer() as s``."""

    def __init__(
        self, config: EngineConfig | None = None, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.config = config or EngineConfig()
        self.host, self.port = host, port
        self._runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI base URL, ending in /v1."""
        return self.base_url + "/v1"

    async def start(self) -> EngineServer:
        self._runner = web.AppRunner(make_engine_app(self.config), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> EngineServer:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def serve_engine(host: str, port: int, config: EngineConfig | None = None) -> None:
    """Serve until cancelled."""
    async with EngineServer(config, host, port):
        await asyncio.Event().wait()


def run_engine(host: str, port: int, config: EngineConfig | None = None) -> None:
    """Blocking: serve until interrupted (Ctrl-C / SIGTERM)."""
    web.run_app(make_engine_app(config), host=host, port=port, access_log=None)
