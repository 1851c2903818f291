"""The request fields that reach the engine: samples, not engine controls.

The agent is driven by the policy being trained, so a field that steers the engine
rather than the sample (scheduling priority, request ids, KV-transfer peers, LoRA paths,
serialized logit processors, hidden states, engine-specific extra args) is something it
could learn to use. Per wire API spoken to the upstream, only the documented
sampling/chat fields below go through; every other top-level field is dropped before the
request is sent, and counted in ``tracetap_request_fields_dropped_total{route,field}``
(the names in ``CONTROLS``; anything else counts as ``other``, so the label set stays
small). The operator lets a field through by name (``serve --allow-request-field NAME``).
Fields named ``mock_*`` (the demo engine's fault injection, read by no real engine) go
through too. docs/apis.md lists the allowlists.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tracetap.proxy.apis.chat import CHAT, COMPLETIONS

_OPENAI_SAMPLING = frozenset({
    "model", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "max_tokens",
    "n", "seed", "stop", "stream", "stream_options", "temperature", "top_p", "user",
    "response_format",
})
# vLLM's and SGLang's extra sampling parameters (their SamplingParams), structured output,
# and the token-id reports capture reads.
_ENGINE_SAMPLING = frozenset({
    "top_k", "min_p", "repetition_penalty", "length_penalty", "min_tokens", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "bad_words", "allowed_token_ids", "truncate_prompt_tokens",
    "no_stop_trim", "add_special_tokens", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "guided_whitespace_pattern", "regex", "ebnf",
    "json_schema", "return_token_ids", "return_tokens_as_token_ids",
    # Refused by capture with a 400 (proxy.apis.chat.inject): the prompt never comes back
    # as completion tokens. Listed so the refusal, not a silent drop, answers them.
    "echo", "prompt_logprobs",
})
ALLOWED: dict[str, frozenset[str]] = {
    CHAT: _OPENAI_SAMPLING | _ENGINE_SAMPLING | {
        "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
        "parallel_tool_calls", "functions", "function_call", "reasoning_effort", "metadata",
        "store", "service_tier", "modalities", "audio", "prediction", "web_search_options",
        "verbosity", "prompt_cache_key", "safety_identifier",
        # chat template options (vLLM, SGLang)
        "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
        "documents", "include_reasoning", "separate_reasoning",
    },
    COMPLETIONS: _OPENAI_SAMPLING | _ENGINE_SAMPLING | {"prompt", "suffix"},
    "responses": frozenset({
        "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
        "max_output_tokens", "max_tool_calls", "temperature", "top_p", "top_logprobs",
        "stream", "stream_options", "reasoning", "text", "include", "store", "metadata",
        "user", "service_tier", "truncation", "prompt_cache_key", "prompt_cache_retention",
        "safety_identifier", "client_metadata", "previous_response_id", "conversation",
        "prompt", "background",
        "top_k", "min_p", "repetition_penalty", "enable_response_messages",
    }),
    "messages": frozenset({
        "model", "messages", "system", "max_tokens", "stop_sequences", "stream",
        "temperature", "top_p", "top_k", "tools", "tool_choice", "metadata", "thinking",
        "service_tier", "output_format", "output_config", "context_management",
        "container", "mcp_servers",
    }),
}
# The engine controls the metric names (vLLM, SGLang); any other dropped field: "other".
CONTROLS = frozenset({
    "priority", "request_id", "rid", "kv_transfer_params", "lora_request", "lora_path",
    "lora_name", "logits_processors", "vllm_xargs", "extra_args", "custom_logit_processor",
    "custom_params", "return_hidden_states", "bootstrap_host", "bootstrap_port",
    "bootstrap_room", "data_parallel_rank", "cache_salt", "chat_template",
    "mm_processor_kwargs", "use_beam_search", "best_of", "return_routed_experts",
    "session_params", "other",
})
OTHER = "other"
_TEST_PREFIX = "mock_"


class RequestFields:
    """The allowlists, plus the fields the operator lets through (one per proxy)."""

    def __init__(self, allowed: Iterable[str] = ()):
        self.extra = frozenset(allowed)  # names checked with the settings

    def drop(self, endpoint: str, payload: dict[str, Any]) -> dict[str, int]:
        """Remove from ``payload`` (in place) the fields the API's upstream may not get;
        returns the counts by metric name (empty when nothing was dropped)."""
        allowed = ALLOWED.get(endpoint)
        if allowed is None:
            return {}
        extra = self.extra
        return _remove(payload, [k for k in payload if k not in allowed and k not in extra
                                 and not k.startswith(_TEST_PREFIX)])

    def drop_controls(self, payload: dict[str, Any]) -> dict[str, int]:
        """Remove the named engine controls only (a request about to be translated: its
        other fields are translation's to map or count)."""
        return _remove(payload, [k for k in payload if k in CONTROLS and k != OTHER
                                 and k not in self.extra])


def _remove(payload: dict[str, Any], keys: list[str]) -> dict[str, int]:
    dropped: dict[str, int] = {}
    for key in keys:
        del payload[key]
        name = key if key in CONTROLS else OTHER
        dropped[name] = dropped.get(name, 0) + 1
    return dropped
