"""Token ids an engine did not return, filled in before a record is written.

Runs in the writer (``Writer(prepare=...)``), never on the request path. Per record:

- **prompt ids**: the engine's own tokenize endpoints, given the request the engine was
  given (``upstream_request`` when tracetap changed it, else ``request``): a chat is
  rendered and tokenized by the engine (vLLM/SGLang ``/tokenize`` with the messages and
  template options; llama-server ``/apply-template`` then ``/tokenize``); a completions
  prompt string is tokenized as the engine tokenizes prompts. Accepted only when the count
  equals the engine's own ``usage.prompt_tokens`` (when it reported one); stored with
  ``prompt_source = "engine_tokenize"``.
- **completion ids**, when the engine gave only per-token strings (logprobs without ids):
  the strings joined are tokenized by the engine, and the ids are accepted only if their
  pieces reproduce the engine's strings one for one (same count, same bytes); stored with
  ``token_source = "verified_retokenized"``. A string holding U+FFFD (bytes the engine
  could not show) is never verified. Anything else stays without ids: it is left out of
  training rather than guessed.

What stays missing is recorded in the call (``ids_missing``), counted per choice with
content in ``tracetap_token_ids_missing_total{reason}`` (a choice lacks ids when its
prompt or its completion does; the prompt's reason first) and logged once per upstream
and reason, with the remedy.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from tracetap.proxy.inject import CHAT, COMPLETIONS
from tracetap.proxy.tokenizers import EngineTokenizer, NoChatTemplate, Quiet, TokenizeFailed, detect
from tracetap.proxy.upstream import UpstreamClient
from tracetap.storage.records import CallRecord, ChoiceRecord

log = logging.getLogger("tracetap.resolve")

# Why ids are missing (storage.records.IDS_MISSING), and what to do about it.
REMEDIES = {
    "no_tokenizer": "the upstream returns no token ids and has no tokenize endpoint "
                    "tracetap knows (/tokenize, /apply-template, /extras/tokenize); serve the "
                    "model with vLLM >= 0.10.2, SGLang or llama.cpp's llama-server",
    "no_chat_template": "the upstream can tokenize text but cannot render a chat "
                        "(llama-cpp-python has no template endpoint), so chat prompts get no "
                        "ids; serve the model with llama.cpp's llama-server (it has "
                        "/apply-template), or send /v1/completions prompts you render yourself",
    "tokenize_failed": "the upstream's tokenize endpoint failed or did not answer; check "
                       "that it is up and serves the same model",
    "count_mismatch": "the engine's tokenizer gave a prompt of another length than the "
                      "engine reported using; the chat template options in the request may "
                      "not reach its tokenize endpoint",
    "no_token_strings": "the upstream returned neither token ids nor logprobs; let the "
                        "client's logprobs through (llama-cpp-python needs --logits_all true)",
    "unverified": "retokenizing the completion did not reproduce the engine's own tokens "
                  "one for one (a split character, a special token, a non-canonical "
                  "segmentation); those completions are kept out of training",
    "unsupported_request": "the request is not one tracetap can tokenize (a batch of "
                           "prompts, or an API without ids)",
}
_decode = msgspec.json.Decoder(dict).decode


class TokenResolver:
    """The writer's ``prepare`` step. ``missing(reason, count)`` is told what stays missing."""

    def __init__(self, client: UpstreamClient, missing=None, concurrency: int = 8):
        self.client = client
        self.on_missing = missing
        # A window with no model call in flight (set by the app: ProxyState.quiet).
        self.quiet: Quiet | None = None
        # Records name an upstream by its shown URL (credentials masked); set by the app.
        self.address: Callable[[str], str] = lambda shown: shown
        self._tokenizers: dict[str, EngineTokenizer | None] = {}
        self._detecting: dict[str, asyncio.Lock] = {}
        self._logged: set[tuple[str, str]] = set()
        self._limit = asyncio.Semaphore(concurrency)

    async def __call__(self, records: list[CallRecord]) -> None:
        todo = [r for r in records if _needs_ids(r)]
        if todo:
            await asyncio.gather(*(self._resolve(r) for r in todo))

    async def _resolve(self, record: CallRecord) -> None:
        async with self._limit:
            tokenizer = await self.tokenizer(record.upstream or "")
            prompt = None
            if record.prompt_ids is None:
                prompt = await self._prompt(record, tokenizer)
            for choice in record.choices:
                completion = None
                if choice.completion_ids is None and (choice.token_strs or choice.text):
                    completion = await _completion(choice, tokenizer)
                if _has_content(choice) and (prompt or completion):
                    self._missing(record, prompt or completion)

    async def tokenizer(self, upstream: str) -> EngineTokenizer | None:
        if upstream in self._tokenizers:
            return self._tokenizers[upstream]
        lock = self._detecting.setdefault(upstream, asyncio.Lock())
        async with lock:
            if upstream not in self._tokenizers:
                found, reached = (await detect(self.client, self.address(upstream),
                                               self.quiet) if upstream else (None, True))
                if not reached:
                    return None  # down for now: asked again with the next record
                self._tokenizers[upstream] = found
                log.info("upstream %s: token ids it does not return come from %s", upstream,
                         f"its {found.kind} tokenize endpoints" if found else "nowhere")
        return self._tokenizers[upstream]

    async def _prompt(self, record: CallRecord, tokenizer: EngineTokenizer | None) -> str | None:
        if tokenizer is None:
            return "no_tokenizer"
        try:
            request = _decode(record.upstream_request or record.request or "")
        except (msgspec.DecodeError, msgspec.ValidationError):
            return "unsupported_request"
        try:
            if _is_chat(record.endpoint):
                ids = await tokenizer.chat_prompt(request)
            elif record.endpoint == COMPLETIONS and isinstance(request.get("prompt"), str):
                ids = await tokenizer.prompt(request["prompt"])
            else:
                return "unsupported_request"
        except NoChatTemplate:
            return "no_chat_template"
        except TokenizeFailed:
            return "tokenize_failed"
        if record.prompt_tokens is not None and len(ids) != record.prompt_tokens:
            return "count_mismatch"
        record.prompt_ids, record.prompt_source = ids, "engine_tokenize"
        return None

    def _missing(self, record: CallRecord, reason: str) -> None:
        record.ids_missing = record.ids_missing or reason
        if self.on_missing is not None:
            self.on_missing(reason)
        key = (record.upstream or "", reason)
        if key not in self._logged:
            self._logged.add(key)
            log.warning("upstream %s: calls stored without token ids (%s) are left out of "
                        "trajectories/; remedy: %s", record.upstream, reason, REMEDIES[reason])


async def _completion(choice: ChoiceRecord, tokenizer: EngineTokenizer | None) -> str | None:
    if tokenizer is None:
        return "no_tokenizer"
    strs = choice.token_strs
    if not strs:
        return "no_token_strings"
    if any("\ufffd" in s for s in strs):
        return "unverified"
    try:
        pieces = await tokenizer.pieces("".join(strs))
    except TokenizeFailed:
        return "tokenize_failed"
    if len(pieces) != len(strs) or any(
            piece is None or piece != text.encode() for (_, piece), text in zip(pieces, strs)):
        return "unverified"
    choice.completion_ids = [token_id for token_id, _ in pieces]
    choice.token_source = "verified_retokenized"
    return None


def _has_content(choice: ChoiceRecord) -> bool:
    return bool(choice.text or choice.token_strs or choice.completion_ids)


def _needs_ids(record: CallRecord) -> bool:
    if record.status != "ok" or record.http_status != 200 or not record.choices:
        return False
    return record.prompt_ids is None or any(
        c.completion_ids is None and (c.token_strs or c.text) for c in record.choices)


def _is_chat(endpoint: str) -> bool:
    """Chat completions, or another API translated to chat on the way up."""
    return endpoint == CHAT or endpoint.endswith(":chat")
