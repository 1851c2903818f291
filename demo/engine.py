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
import dataclasses
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from tracetap.demo import continuation, engine_info, experts, messages, responses, sending, sglang
from tracetap.demo import tokenizer as tok
from tracetap.demo.engine_common import (
    ABORTS,
    CONFIG,
    Aborts,
    ApiError,
    EngineConfig,
)
from tracetap.demo.engine_common import json_response as _json
from tracetap.demo.generate import (
    TOP_LOGPROBS_MAX,
    Completion,
    Sampling,
    generate_chat,
    generate_text,
)
from tracetap.demo.wire import (
    LLAMA_SERVER,
    OPENAI_FIELDS,
    ChatRequest,
    ChatTurn,
    CompletionRequest,
    EngineRequest,
    InputError,
    Shape,
    chat_body,
    chat_chunks,
    completion_body,
    completion_chunks,
    error_body,
)

__all__ = ["EngineConfig", "EngineServer", "make_engine_app", "run_engine", "serve_engine"]
VLLM_VERSION = engine_info.VLLM_VERSION


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


@web.middleware
async def _count_aborts(request: web.Request, handler: Any) -> web.StreamResponse:
    """A client that closes its connection mid-answer aborts the request (as in vLLM)."""
    try:
        return await handler(request)
    except (ConnectionResetError, asyncio.CancelledError):
        request.app[ABORTS].count += 1
        raise


_OPENAI_FIELDS = OPENAI_FIELDS | {responses.ResponsesRequest: responses.OPENAI_FIELDS}


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
        if request.transport is None or request.transport.is_closing():
            # Like vLLM, which checks for a disconnected client while it generates.
            raise ConnectionResetError("the client went away: request aborted")
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
    if config.flavor == "sglang":  # its reply's id is the request's rid (its own, else new)
        rid = req.rid or uuid.uuid4().hex
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
    routed = experts.wanted(config, req)
    if config.flavor == "sglang":
        return await sglang.send_chat(request, req, shape, prompt_ids, completions)
    if req.stream:
        chunks = chat_chunks(shape, prompt_ids, completions)
        chunks = experts.chunks(chunks) if routed else chunks
        return await sending.send_stream(request, req, chunks, config.chunk_delay_s,
                                         interrupted=_interrupter(request))
    body = chat_body(shape, prompt_ids, completions)
    return await sending.send_body(request, req,
                                   experts.add(body, prompt_ids) if routed else body)


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
    rest = continuation.remaining(req.prompt, sampling.content)
    if rest != sampling.content:  # a cut answer sent back to be continued
        sampling = dataclasses.replace(sampling, content=rest)
    shape = _shape(request, req, "cmpl-", req.logprobs, "logprobs")
    batch = _prompts(req.prompt)
    results = [(p, generate_text(p, j, sampling)) for p in batch for j in range(req.n or 1)]
    prompt_tokens = sum(len(p) for p in batch)
    routed = experts.wanted(config, req)
    if config.flavor == "sglang":
        return await sglang.send_completion(request, req, shape, results, prompt_tokens)
    if req.stream:
        chunks = completion_chunks(shape, results, prompt_tokens)
        chunks = experts.chunks(chunks) if routed else chunks
        return await sending.send_stream(request, req, chunks, config.chunk_delay_s,
                                         interrupted=_interrupter(request))
    body = completion_body(shape, results, prompt_tokens)
    return await sending.send_body(request, req, experts.add(body) if routed else body)


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



def make_engine_app(config: EngineConfig | None = None) -> web.Application:
    config = config or EngineConfig()
    app = web.Application(middlewares=[_count_arrivals, _count_aborts, _errors],
                          client_max_size=64 * 1024 * 1024)
    app[CONFIG] = config
    app[ARRIVALS] = Arrivals()
    app[ABORTS] = Aborts()
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", engine_info.models)
    app.router.add_get("/health", engine_info.health)
    if config.flavor in ("vllm", "openai"):
        app.router.add_post("/v1/responses", create_response)
    if config.flavor == "vllm":
        app.router.add_post("/v1/messages", create_message)
        app.router.add_post("/v1/messages/count_tokens", count_tokens)
        app.router.add_get("/version", engine_info.version)
        app.router.add_post("/tokenize", engine_info.tokenize)
        app.router.add_post("/detokenize", engine_info.detokenize)
    if config.flavor == "sglang":
        sglang.add_routes(app)
    if config.flavor in LLAMA_SERVER:
        app.router.add_post("/tokenize", engine_info.llama_tokenize)
        app.router.add_post("/detokenize", engine_info.llama_detokenize)
        app.router.add_post("/apply-template", engine_info.apply_template)
    if config.flavor == "llama-cpp-python":
        app.router.add_post("/extras/tokenize", engine_info.extras_tokenize)
        app.router.add_post("/extras/tokenize/count", engine_info.extras_tokenize)
        app.router.add_post("/extras/detokenize", engine_info.extras_detokenize)
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
