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
- with ``--tokenizer`` (proxy.tokens.local_tokenizer), the local tokenizer does both instead of
  the engine, and the engine is never asked: a chat prompt is accepted only when its
  length equals the engine's ``usage.prompt_tokens``, completion ids as above; both
  stored with the source ``local_tokenizer``.

Questions to an engine that cuts streams (llama-cpp-python, or an engine not identified
yet) are asked only while no call to it is in flight (proxy.upstream.traffic); a record whose
engine is busy is handed back to the writer, which keeps it journaled and offers it again
(``Writer.held`` counts them). Nothing asks mid-stream, however long the stream.

What stays missing is recorded in the call (``ids_missing``), counted per choice with
content in ``tracetap_token_ids_missing_total{reason}`` (a choice lacks ids when its
prompt or its completion does; the prompt's reason first) and logged once per upstream
and reason, with the remedy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import msgspec

from tracetap.proxy.apis.chat import CHAT, COMPLETIONS
from tracetap.proxy.tokens.engine_tokenizer import (
    EngineTokenizer,
    NoChatTemplate,
    TokenizeFailed,
    UnreadableRequest,
    detect,
)
from tracetap.proxy.tokens.local_tokenizer import LocalTokenizer
from tracetap.proxy.tokens.prompt_prefix import PromptPrefixes
from tracetap.proxy.upstream.client import UpstreamClient
from tracetap.proxy.upstream.traffic import Traffic
from tracetap.storage.records import CallRecord, ChoiceRecord, has_prompt_ids

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
    "no_prompt_count": "the engine reported no usage.prompt_tokens for this call "
                       "(llama-cpp-python sends no usage in streams), so the prompt --tokenizer "
                       "rendered could not be checked; calls that are not streamed get "
                       "verified prompt ids",
    "engine_busy": "the engine cuts streams when asked anything (llama-cpp-python) and was "
                   "never idle while these records waited, so its tokenizer was not asked; "
                   "pass --tokenizer (the engine is then never asked) or run the server "
                   "with --interrupt_requests false",
}
# Engines of these kinds never cut a stream when asked something else meanwhile.
PATIENT_FLAVORS = frozenset({"vllm", "sglang", "llamacpp"})
_decode = msgspec.json.Decoder(dict).decode


class TokenResolver:
    """The writer's ``prepare`` step: fills in ids, and hands back the records it must not
    resolve yet. ``missing(reason, count)`` is told what stays missing."""

    def __init__(self, client: UpstreamClient, missing=None, concurrency: int = 8, *,
                 local: LocalTokenizer | None = None, processes: int = 1,
                 traffic: Callable[[str], Traffic | None] = lambda upstream: None,
                 flavor: Callable[[], str] = lambda: "openai",
                 address: Callable[[str], str] = lambda shown: shown,
                 prefixes: PromptPrefixes | None = None):
        self.client = client
        # Each episode's last prompt ids: an agent's next prompt extends them, and its
        # answer is decoded in its new ids only (the relay's, shared: one bound, and
        # forgotten with the episode).
        self.prefixes = prefixes if prefixes is not None else PromptPrefixes()
        self.on_missing = missing
        self.local = local
        self.processes = processes  # serve --workers: each knows only its own calls
        # The calls in flight to an upstream (the pool's), and the engine's kind now.
        self.traffic = traffic
        self.flavor = flavor
        # Records name an upstream by its shown URL (credentials masked).
        self.address = address
        self._tokenizers: dict[str, EngineTokenizer | None] = {}
        self._detecting: dict[str, asyncio.Lock] = {}
        self._logged: set[tuple[str, str]] = set()
        self._limit = asyncio.Semaphore(concurrency)

    async def __call__(self, records: list[CallRecord], hold: bool = True) -> list[CallRecord]:
        """Resolve what can be resolved now; return the records to offer again later.
        With ``hold`` False nothing is handed back: what would wait is stored as
        ``engine_busy`` (the writer's journal has no room to keep it waiting)."""
        todo = [r for r in records if _needs_ids(r)]
        done = await asyncio.gather(*(self._resolve(r, hold) for r in todo))
        return [r for r, finished in zip(todo, done) if not finished]

    async def _resolve(self, record: CallRecord, hold: bool) -> bool:
        async with self._limit:
            if self.local is not None:
                self._complete(record, *await self._locally(record))
                return True
            upstream = record.upstream or ""
            async with self._window(upstream) as quiet:
                if quiet:
                    tokenizer = await self.tokenizer(upstream)
                    prompt = None
                    if not has_prompt_ids(record):
                        prompt = await self._prompt(record, tokenizer)
                    completions = [await _completion(c, tokenizer, record.completion_tokens)
                                   if c.completion_ids is None and (c.token_strs or c.text)
                                   else None for c in record.choices]
            if not quiet and hold:
                return False
            if not quiet:
                prompt, completions = "engine_busy", ["engine_busy"] * len(record.choices)
            self._complete(record, prompt, completions)
            return True

    def _complete(self, record: CallRecord, prompt: str | None,
                  completions: list[str | None]) -> None:
        for choice, completion in zip(record.choices, completions):
            if _has_content(choice) and (prompt or completion):
                self._missing(record, prompt or completion)

    def _window(self, upstream: str):
        """Where the engine may be asked now: at once if it never cuts streams, else only
        in a window with no call to it in flight (none now: not asked)."""
        traffic = self.traffic(upstream)
        if upstream in self._tokenizers:
            known = self._tokenizers[upstream]
            cuts = known is not None and known.interrupts_streams
        else:  # not identified yet: the probes themselves could cut a stream
            cuts = self.flavor() not in PATIENT_FLAVORS
        if traffic is None or not cuts:
            return contextlib.nullcontext(True)
        return traffic.try_window()

    async def _locally(self, record: CallRecord) -> tuple[str | None, list[str | None]]:
        local = self.local
        assert local is not None
        prompt = None
        if not has_prompt_ids(record):
            prompt = await asyncio.to_thread(_local_prompt, record, local)
        completions = []
        for choice in record.choices:
            completion = None
            if choice.completion_ids is None and (choice.token_strs or choice.text):
                completion = await asyncio.to_thread(_local_completion, choice, local,
                                                     record.completion_tokens)
            completions.append(completion)
        return prompt, completions

    async def identify(self, upstreams: list[str]) -> None:
        """Find each upstream's tokenizer at start, while no call is in flight yet (one
        that arrives meanwhile waits for the probes): later a busy upstream of an unknown
        kind could otherwise keep its records waiting. Not needed for a kind that never
        cuts streams, nor with --tokenizer (the engine is never asked)."""
        if self.local is not None or self.flavor() in PATIENT_FLAVORS:
            return
        for upstream in upstreams:
            traffic = self.traffic(upstream)
            async with traffic.window() if traffic else contextlib.nullcontext():
                await self.tokenizer(upstream)

    async def tokenizer(self, upstream: str) -> EngineTokenizer | None:
        if upstream in self._tokenizers:
            return self._tokenizers[upstream]
        lock = self._detecting.setdefault(upstream, asyncio.Lock())
        async with lock:
            if upstream not in self._tokenizers:
                found, reached = (await detect(self.client, self.address(upstream))
                                  if upstream else (None, True))
                if not reached:
                    return None  # down for now: asked again with the next record
                self._tokenizers[upstream] = found
                log.info("upstream %s: token ids it does not return come from %s", upstream,
                         f"its {found.kind} tokenize endpoints" if found else "nowhere")
                if found is not None and found.interrupts_streams and self.processes > 1:
                    log.warning("upstream %s (%s) ends a stream when asked anything, and "
                                "with --workers %d no worker sees the others' calls: its "
                                "tokenizer may cut their streams; pass --tokenizer, serve it "
                                "with --interrupt_requests false, or use one worker",
                                upstream, found.kind, self.processes)
        return self._tokenizers[upstream]

    async def _prompt(self, record: CallRecord, tokenizer: EngineTokenizer | None) -> str | None:
        if tokenizer is None:
            return "no_tokenizer"
        if _is_chat(record.endpoint):
            try:
                array = await tokenizer.chat_prompt_array(
                    record.upstream_request or record.request or "")
            except UnreadableRequest:
                return "unsupported_request"
            except TokenizeFailed:
                return "tokenize_failed"
            if array is not None:
                return self._keep_array(record, array)
        request = _request(record)
        if request is None:
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
        return _keep_prompt(record, ids, "engine_tokenize")

    def _keep_array(self, record: CallRecord, array: bytes) -> str | None:
        """The engine's JSON array of prompt ids, decoded in the ids that extend the
        episode's last prompt only; kept packed when the count is the engine's."""
        try:
            ids, packed = self.prefixes.decode_packed(record.episode_id, array)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return "tokenize_failed"  # not a list of ints (a bool, a float, a string)
        count = len(ids) if ids is not None else len(packed or b"") // 4
        if record.prompt_tokens is not None and count != record.prompt_tokens:
            return "count_mismatch"
        record.prompt_ids, record.prompt_ids_packed = ids, packed
        record.prompt_source = "engine_tokenize"
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


def _request(record: CallRecord) -> dict | None:
    try:
        request = _decode(record.upstream_request or record.request or "")
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return request


def _local_prompt(record: CallRecord, local: LocalTokenizer) -> str | None:
    """The prompt ids --tokenizer gives, kept only when the engine's count agrees."""
    request = _request(record)
    if request is None:
        return "unsupported_request"
    try:
        if _is_chat(record.endpoint):
            ids = local.chat_prompt(request)
            if record.prompt_tokens is None:
                return "no_prompt_count"  # a template is only trusted when checked
        elif record.endpoint == COMPLETIONS and isinstance(request.get("prompt"), str):
            ids = local.prompt(request["prompt"])
        else:
            return "unsupported_request"
    except TokenizeFailed:
        return "tokenize_failed"
    return _keep_prompt(record, ids, "local_tokenizer")


def _keep_prompt(record: CallRecord, ids: list[int], source: str) -> str | None:
    """Prompt ids are kept only when their count is the engine's (when it gave one)."""
    if record.prompt_tokens is not None and len(ids) != record.prompt_tokens:
        return "count_mismatch"
    record.prompt_ids, record.prompt_source = ids, source
    return None


def _local_completion(choice: ChoiceRecord, local: LocalTokenizer,
                      sampled: int | None) -> str | None:
    strs = choice.token_strs
    if not strs:
        return "no_token_strings"
    if _unverifiable(strs, sampled):
        return "unverified"
    return _accept(choice, local.pieces("".join(strs)), "local_tokenizer")


async def _completion(choice: ChoiceRecord, tokenizer: EngineTokenizer | None,
                      sampled: int | None) -> str | None:
    if tokenizer is None:
        return "no_tokenizer"
    strs = choice.token_strs
    if not strs:
        return "no_token_strings"
    if _unverifiable(strs, sampled):
        return "unverified"
    try:
        pieces = await tokenizer.pieces("".join(strs))
    except TokenizeFailed:
        return "tokenize_failed"
    return _accept(choice, pieces, "verified_retokenized")


def _unverifiable(strs: list[str], sampled: int | None) -> bool:
    """Strings that cannot be the engine's own sampled tokens: one it could not show
    (U+FFFD), or more of them than the engine reports sampling for the call (``usage``:
    such strings hold something else, e.g. an echoed prompt)."""
    return (sampled is not None and len(strs) > sampled) or any("\ufffd" in s for s in strs)


def _accept(choice: ChoiceRecord, pieces: list[tuple[int, bytes | None]],
            source: str) -> str | None:
    """Ids whose pieces reproduce the engine's own strings one for one, or why not."""
    strs = choice.token_strs or []
    if len(pieces) != len(strs) or any(
            piece is None or piece != text.encode() for (_, piece), text in zip(pieces, strs)):
        return "unverified"
    choice.completion_ids = [token_id for token_id, _ in pieces]
    choice.token_source = source
    return None


def _has_content(choice: ChoiceRecord) -> bool:
    return bool(choice.text or choice.token_strs or choice.completion_ids)


def _needs_ids(record: CallRecord) -> bool:
    if record.status != "ok" or record.http_status != 200 or not record.choices:
        return False
    return not has_prompt_ids(record) or any(
        c.completion_ids is None and (c.token_strs or c.text) for c in record.choices)


def _is_chat(endpoint: str) -> bool:
    """Chat completions, or another API translated to chat on the way up."""
    return endpoint == CHAT or endpoint.endswith(":chat")
