"""The records the proxy hands to storage: the one typed boundary between them."""

from __future__ import annotations

import msgspec

from tracetap.storage.codec import unpack_ids


class ChoiceRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One upstream choice (``n`` > 1 gives several per call)."""

    index: int
    finish_reason: str | None = None
    text: str | None = None
    completion_ids: list[int] | None = None
    completion_logprobs: list[float] | None = None
    # Raw per-token alternatives, only when the client asked for top_logprobs.
    top_logprobs: list | None = None
    # Where the completion ids came from (TOKEN_SOURCES).
    token_source: str = "none"
    # The engine's own string for each completion token, kept only while the ids are
    # missing: the writer's resolver checks a retokenization against them. Not stored.
    token_strs: list[str] | None = None
    # [(start_token, version or None)]: set only when the tokens are not all from the
    # call's policy_version (a weight sync during the call; None = unknown); revision 0009.
    policy_spans: list[tuple[int, str | None]] | None = None
    # The MoE experts the engine routed each completion token to (--routed-experts):
    # storage.experts.pack's bytes (layers, top_k, then int16 ids); revision 0009.
    routed_experts: bytes | None = None


class CallRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Everything captured about one model call, finished or cut short."""

    call_id: str
    episode_id: str | None = None
    seq: int = 0
    instance: str = ""
    endpoint: str
    model: str | None = None
    policy_version: str | None = None
    stream: bool = False
    upstream: str | None = None
    # The client's request body (JSON text) with nothing secret in it.
    request: str | None = None
    # The upstream response as the proxy saw it; streams are reassembled.
    response: str | None = None
    status: str = "ok"
    http_status: int = 0
    error: str | None = None
    t_start: float
    t_first_byte: float | None = None
    t_end: float | None = None
    upstream_latency: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_ids: list[int] | None = None
    # The prompt ids as int32 little-endian bytes (storage.codec.pack_ids) instead of
    # prompt_ids (then None), when the proxy packed them as it decoded them (in the new
    # tokens only, proxy.tokens.prompt_prefix): no list of the whole prompt is made, journaled or
    # packed again at each call. Read either with ``prompt_ids_of``.
    prompt_ids_packed: bytes | None = None
    # Where prompt_ids came from (PROMPT_SOURCES); None: "engine" if there are ids, else "none".
    prompt_source: str | None = None
    # The body sent upstream when the engine rendered something else than the client's
    # request (a translated API, a repaired history): the model's view, kept beside it.
    upstream_request: str | None = None
    # Why some of the call's token ids are missing (proxy.tokens.resolve.REMEDIES), if they are.
    ids_missing: str | None = None
    # JSON: the overlay the call ran under, its events and what the harness received
    # when that was not the model's reply (docs/overlays.md); None without an overlay.
    overlay: str | None = None
    # JSON {field: count}: request fields translation to chat dropped (proxy.apis.dropped);
    # None when nothing was dropped or the call was not translated.
    translation_dropped: str | None = None
    # Lineage (exporters.lineages): the harness's names for the conversation the call
    # belongs to and its parent (X-Tracetap-Lineage / X-Tracetap-Parent), when it sent
    # them; ``conversation``: the hashes of the request's start (proxy.episodes.lineage).
    lineage: str | None = None
    parent_lineage: str | None = None
    conversation: str | None = None
    choices: list[ChoiceRecord] = []


def has_prompt_ids(record: CallRecord) -> bool:
    return record.prompt_ids is not None or record.prompt_ids_packed is not None


def prompt_ids_of(record: CallRecord) -> list[int] | None:
    """The record's prompt ids as a list, however it holds them."""
    if record.prompt_ids is not None or record.prompt_ids_packed is None:
        return record.prompt_ids
    return unpack_ids(record.prompt_ids_packed)


# Where a choice's completion ids came from, most trusted first: the engine's token_ids;
# ids the engine put in its logprob entries (vLLM's "token_id:N" strings, llama.cpp's
# "id"), as exact as the first; the completion tokenized again by the engine's own
# tokenizer and accepted only because its pieces reproduce the engine's per-token strings
# one for one; the same check against the local tokenizer named by --tokenizer (the engine
# is not asked); none.
TOKEN_SOURCES = ("engine", "logprobs", "verified_retokenized", "local_tokenizer", "none")
# Where a call's prompt ids came from: the engine's reply; the client's request (a
# completions prompt sent as ids); the engine's tokenize endpoints, called after the reply
# with the same messages and template options; the local tokenizer named by --tokenizer
# (rendered and tokenized by tracetap, kept only when its length equals the engine's
# usage.prompt_tokens); none.
PROMPT_SOURCES = ("engine", "request", "engine_tokenize", "local_tokenizer", "none")
# Why a call's ids are missing (calls.ids_missing); the remedies are in proxy.tokens.resolve.
IDS_MISSING = ("no_tokenizer", "no_chat_template", "tokenize_failed", "count_mismatch",
               "no_token_strings", "unverified", "unsupported_request", "no_prompt_count",
               "engine_busy")


# Statuses a stored call can have. "ok" covers any upstream reply, 4xx/5xx included
# (the HTTP status says which); the rest mean the exchange did not complete normally.
STATUSES = (
    "ok",
    "client_disconnected",
    "upstream_error",
    "upstream_unreachable",
    "upstream_timeout",
    "bad_request",
    "paused",
    "budget_exceeded",
    "passthrough",  # an exposed, uncaptured path (e.g. count_tokens) called in an episode
    "vetoed",  # an overlay rejected the reply and had the model sample again
    "overlay_failed",  # an overlay hook failed under --overlay-fail closed
    "record_dropped",  # a tombstone: the record was lost, the journal was full
    "record_quarantined",  # a tombstone: the database refused the record (dead-letter file)
    "record_lost",  # a tombstone: its replica died or was declared lost (storage.intents)
    "weight_sync_retried",  # cut by a pause in abort mode and sent again (proxy.call.continuation)
    "error",  # the proxy failed on the request itself (500 internal_error)
    "proxy_stopped",  # the proxy was stopped under the call (past --drain-timeout)
    "other_model",  # served a model outside its episode's policy models (--other-models store)
    "deadline_exceeded",  # ended past --call-deadline (proxy.call.deadline)
    "client_stalled",  # ended past --call-deadline, its client not reading the stream
)
