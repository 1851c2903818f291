"""The mock engine's ``sglang`` flavor: SGLang's reply shapes, taken from SGLang 0.5.23
(``sglang/srt/entrypoints/openai/protocol.py``, ``serving_chat.py``,
``serving_completions.py``, ``sse_utils.py``, ``entrypoints/http_server.py``).

- Chat: ``return_token_ids`` puts ``prompt_token_ids`` and ``response_token_ids`` in each
  choice of a whole reply and is refused on a stream (400). ``return_input_ids_in_sglext``
  / ``return_output_ids_in_sglext`` put ``sglext: {input_ids, output_ids: [[...] per
  choice]}`` at a body's top level, or, streamed, in one chunk with ``choices: []`` after
  each choice's finish chunk (role chunk, content chunks, a finish chunk with an empty
  delta and ``matched_stop``). Content chunks carry no ``usage`` key; the sglext and usage
  chunks carry ``usage: null`` / the usage.
- Completions: ``token_ids`` and ``prompt_token_ids`` inside the choice (the prompt's in
  a stream's first chunk only), left out when not asked; every chunk has ``usage: null``;
  legacy logprobs have ``text_offset`` -1.
- ``matched_stop``: the stop string, or the EOS id, that ended the text.
- ``return_routed_experts``: ``sglext.routed_experts``, base64 of int32 expert ids, one
  ``[layers][top_k]`` row per position but the last (prompt then output, the first
  choice's), no shape (``managers/detokenizer_manager.py``, ``serving_chat.py``).
- ``/abort_request {"rid"}`` or ``{"abort_all": true}``: a stream so aborted ends as a
  finished one with ``finish_reason: "abort"``, its ids so far still in ``sglext``.
- ``/tokenize`` → ``{tokens, count, max_model_len}``; ``/detokenize`` → ``{text}`` (special
  tokens skipped unless ``skip_special_tokens: false``); ``/get_model_info`` and
  ``/model_info``; ``/server_info`` (``version``); errors ``{"object": "error", ...}``.
"""

from __future__ import annotations

import base64
import sys
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

from aiohttp import web

from tracetap.demo import experts, sending
from tracetap.demo import tokenizer as tok
from tracetap.demo.engine_common import CONFIG, ApiError
from tracetap.demo.engine_common import json_response as _json
from tracetap.demo.engine_info import object_body
from tracetap.demo.generate import Completion, logprob_rows
from tracetap.demo.wire import Shape, chat_logprobs, error_body

VERSION = "0.5.23"


class Aborted:
    """Rids aborted through ``/abort_request`` (``"*"``: all the streams now running)."""

    def __init__(self) -> None:
        self.rids: set[str] = set()
        self.epoch = 0  # bumped by abort_all
        self.count = 0
        # Faults a test sets: the status ``/abort_request`` answers (not 200: nothing is
        # aborted), and an aborted stream's ending without its ids (SGLang leaves them out
        # after an error abort).
        self.answer = 200
        self.drop_ids = False

    def watch(self, rid: str):
        epoch = self.epoch
        return lambda: rid in self.rids or self.epoch != epoch


ABORTED = web.AppKey("sglang_aborted", Aborted)


def error(status: int, message: str) -> dict[str, Any]:
    return error_body("sglang", status, message)


def _matched(c: Completion, finish: str) -> str | int | None:
    if finish != "stop":
        return None
    return c.stop_reason if c.stop_reason is not None else tok.EOS


def _usage(prompt_tokens: int, out: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + out,
            "completion_tokens": out, "prompt_tokens_details": None, "reasoning_tokens": 0,
            "completion_tokens_details": None}


def _head(shape: Shape, obj: str) -> dict[str, Any]:
    return {"id": shape.id, "object": obj, "created": shape.created, "model": shape.model}


def routed(prompt_ids: Sequence[int], output_ids: Sequence[int]) -> str:
    """SGLang's ``sglext.routed_experts``: base64 of the int32 ``[seqlen - 1][layers]
    [top_k]`` expert ids of every position that went through the model (the prompt, then
    the output less its last token), no shape given (``detokenizer_manager``)."""
    rows = experts.route([*prompt_ids, *output_ids][:-1])
    flat = array("i", (e for row in rows for layer in row for e in layer))
    if sys.byteorder != "little":
        flat.byteswap()
    return base64.b64encode(flat.tobytes()).decode()


def _ext(shape: Shape, prompt_ids: list[int], outputs: Sequence[list[int]]) -> dict | None:
    ext: dict[str, Any] = {}
    if getattr(shape.req, "return_routed_experts", None) and outputs:
        ext["routed_experts"] = routed(prompt_ids, outputs[0])  # the first choice's only
    if getattr(shape.req, "return_input_ids_in_sglext", None):
        ext["input_ids"] = prompt_ids
    if getattr(shape.req, "return_output_ids_in_sglext", None):
        ext["output_ids"] = [list(ids) for ids in outputs]
    return ext or None


# ---- chat ------------------------------------------------------------------------------


def chat_body(shape: Shape, prompt_ids: list[int], completions: list[Completion]) -> dict:
    want_ids = bool(shape.req.return_token_ids)
    choices = []
    for i, c in enumerate(completions):
        message = {"role": "assistant", "content": c.content or "", "reasoning_content": None}
        message |= {"tool_calls": c.tool_calls} if c.tool_calls else {}
        choice = {"index": i, "message": message,
                  "logprobs": chat_logprobs(shape, c, 0, c.token_ids),
                  "finish_reason": c.finish_reason,
                  "matched_stop": _matched(c, c.finish_reason)}
        if want_ids:
            choice |= {"prompt_token_ids": prompt_ids, "response_token_ids": c.token_ids}
        choices.append(choice)
    out = sum(len(c.token_ids) for c in completions)
    body = _head(shape, "chat.completion") | {"choices": choices,
                                              "usage": _usage(len(prompt_ids), out),
                                              "metadata": {"weight_version": "default"}}
    ext = _ext(shape, prompt_ids, [c.token_ids for c in completions])
    return body | ({"sglext": ext} if ext else {})


def _chunk(shape: Shape, index: int, delta: dict, logprobs: Any = None,
           finish: str | None = None, matched: Any = None) -> dict[str, Any]:
    choice = {"index": index, "delta": {"reasoning_content": None} | delta,
              "logprobs": logprobs, "finish_reason": finish, "matched_stop": matched}
    return _head(shape, "chat.completion.chunk") | {"choices": [choice]}


def _delta(c: Completion, event: Any) -> dict[str, Any]:
    if event.kind == "content":
        return {"content": event.text}
    if event.kind == "hidden":
        return {}
    call = c.tool_calls[event.tool_index]
    function = {"arguments": event.text}
    if event.kind == "tool_head":
        function = {"name": call["function"]["name"], "arguments": ""}
    head = {"id": call["id"], "type": "function"} if event.kind == "tool_head" else {}
    return {"tool_calls": [{"index": event.tool_index, **head, "function": function}]}


def chat_chunks(shape: Shape, prompt_ids: list[int], completions: list[Completion],
                aborted, drop_ids: bool = False) -> Iterator[dict]:
    """SGLang's stream; ``aborted()`` turning true ends every choice with ``abort`` (and,
    with ``drop_ids``, its ending without the ids)."""
    sent: list[list[int]] = [[] for _ in completions]
    for i in range(len(completions)):
        yield _chunk(shape, i, {"role": "assistant", "content": ""})
    finish = {}
    for step in range(max(len(c.events) for c in completions)):
        if aborted():
            break
        for i, c in enumerate(completions):
            if step < len(c.events):
                event = c.events[step]
                sent[i].extend(event.ids)
                yield _chunk(shape, i, _delta(c, event),
                             chat_logprobs(shape, c, event.start, event.ids))
                if step == len(c.events) - 1:
                    finish[i] = c.finish_reason
    for i, c in enumerate(completions):
        reason = finish.get(i, "abort")
        yield _chunk(shape, i, {}, finish=reason, matched=_matched(c, reason))
    ext = _ext(shape, prompt_ids, sent)
    if ext and len(finish) < len(completions) and drop_ids:
        ext = None  # an error abort: SGLang's ending leaves the ids out
    if ext:
        yield _head(shape, "chat.completion.chunk") | {"choices": [], "usage": None, "sglext": ext}
    if shape.include_usage:
        usage = _usage(len(prompt_ids), sum(len(ids) for ids in sent))
        yield _head(shape, "chat.completion.chunk") | {"choices": [], "usage": usage}


# ---- completions -----------------------------------------------------------------------


def _legacy_logprobs(shape: Shape, c: Completion, start: int, ids: Sequence[int]) -> dict | None:
    if shape.top_k is None:
        return None
    rows = logprob_rows(c.key, ids, start, shape.top_k)
    return {"text_offset": [-1] * len(ids), "token_logprobs": [r.logprob for r in rows],
            "tokens": [tok.token_str(t) for t in ids],
            "top_logprobs": [{tok.token_str(t): lp for t, lp in r.top} for r in rows]}


def _text_choice(shape: Shape, index: int, c: Completion, events: Sequence[Any],
                 prompt: list[int] | None) -> dict[str, Any]:
    ids = [t for e in events for t in e.ids]
    finish = c.finish_reason if events[-1] is c.events[-1] else None
    choice = {"index": index, "text": "".join(e.text for e in events),
              "logprobs": _legacy_logprobs(shape, c, events[0].start, ids),
              "finish_reason": finish, "matched_stop": _matched(c, finish or "")}
    if shape.req.return_token_ids:
        choice["token_ids"] = ids
        choice |= {"prompt_token_ids": prompt} if prompt is not None else {}
    return choice


def completion_body(shape: Shape, results: list[tuple[list[int], Completion]],
                    prompt_tokens: int) -> dict:
    choices = [_text_choice(shape, i, c, c.events, p) for i, (p, c) in enumerate(results)]
    out = sum(len(c.token_ids) for _, c in results)
    body = _head(shape, "text_completion") | {"choices": choices,
                                              "usage": _usage(prompt_tokens, out)}
    return body | _completion_ext(shape, results)


def _completion_ext(shape: Shape, results: list[tuple[list[int], Completion]]) -> dict:
    if not getattr(shape.req, "return_routed_experts", None):
        return {}
    prompt, c = results[0]
    return {"sglext": {"routed_experts": routed(prompt, c.token_ids)}}


def completion_chunks(shape: Shape, results: list[tuple[list[int], Completion]],
                      prompt_tokens: int) -> Iterator[dict]:
    for step in range(max(len(c.events) for _, c in results)):
        for i, (p, c) in enumerate(results):
            if step < len(c.events):
                choice = _text_choice(shape, i, c, c.events[step:step + 1],
                                      p if step == 0 else None)
                yield _head(shape, "text_completion") | {"choices": [choice], "usage": None}
    ext = _completion_ext(shape, results)
    if ext:
        yield _head(shape, "text_completion") | {"choices": [], "usage": None} | ext
    if shape.include_usage:
        out = sum(len(c.token_ids) for _, c in results)
        yield _head(shape, "text_completion") | {"choices": [],
                                                 "usage": _usage(prompt_tokens, out)}


async def send_chat(request: web.Request, req: Any, shape: Shape, prompt_ids: list[int],
                    completions: list[Completion]) -> web.StreamResponse:
    if not req.stream:
        return await sending.send_body(request, req, chat_body(shape, prompt_ids, completions))
    if req.return_token_ids:
        raise ApiError(400, "return_token_ids is not supported with streaming on "
                       "/v1/chat/completions. Please set stream=false when using "
                       "return_token_ids=true.")
    aborted = request.app[ABORTED]
    chunks = chat_chunks(shape, prompt_ids, completions, aborted.watch(shape.id),
                         aborted.drop_ids)
    return await sending.send_stream(request, req, chunks, request.app[CONFIG].chunk_delay_s)


async def send_completion(request: web.Request, req: Any, shape: Shape,
                          results: list[tuple[list[int], Completion]],
                          prompt_tokens: int) -> web.StreamResponse:
    if not req.stream:
        body = completion_body(shape, results, prompt_tokens)
        return await sending.send_body(request, req, body)
    chunks = completion_chunks(shape, results, prompt_tokens)
    return await sending.send_stream(request, req, chunks, request.app[CONFIG].chunk_delay_s)


# ---- other endpoints -------------------------------------------------------------------


async def tokenize(request: web.Request) -> web.Response:
    body = await object_body(request)
    if (body.get("prompt") is None) == (body.get("messages") is None):
        return _json(error(400, "Exactly one of 'prompt' or 'messages' must be provided."), 400)
    if isinstance(body.get("messages"), list):
        gen = body.get("add_generation_prompt")
        ids = tok.apply_chat_template(body["messages"], body.get("tools"), gen is not False)
    else:
        ids = tok.encode(str(body["prompt"]))
    max_len = request.app[CONFIG].max_model_len
    return _json({"tokens": ids, "count": len(ids), "max_model_len": max_len})


async def detokenize(request: web.Request) -> web.Response:
    body = await object_body(request)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        return _json(error(400, "tokens must be a list of ids"), 400)
    if body.get("skip_special_tokens", True):
        tokens = [t for t in tokens if t < 256]
    return _json({"text": tok.decode(tokens)})


async def model_info(request: web.Request) -> web.Response:
    model = request.app[CONFIG].model
    return _json({"model_path": model, "served_model_name": model, "tokenizer_path": model,
                  "is_generation": True, "preferred_sampling_params": None,
                  "weight_version": "default"})


async def server_info(request: web.Request) -> web.Response:
    return _json({"model_path": request.app[CONFIG].model, "version": VERSION,
                  "frontend": "python", "internal_states": []})


async def abort_request(request: web.Request) -> web.Response:
    body = await object_body(request)
    aborted = request.app[ABORTED]
    aborted.count += 1
    if aborted.answer != 200:
        return _json(error(aborted.answer, "abort refused"), aborted.answer)
    if body.get("abort_all"):
        aborted.epoch += 1
    elif isinstance(body.get("rid"), str):
        aborted.rids.add(body["rid"])
    return web.Response(status=200)


def add_routes(app: web.Application) -> None:
    app[ABORTED] = Aborted()
    for path, handler in (("/tokenize", tokenize), ("/detokenize", detokenize),
                          ("/v1/tokenize", tokenize), ("/v1/detokenize", detokenize),
                          ("/abort_request", abort_request)):
        app.router.add_post(path, handler)
    for path, handler in (("/get_model_info", model_info), ("/model_info", model_info),
                          ("/server_info", server_info), ("/get_server_info", server_info)):
        app.router.add_get(path, handler)
