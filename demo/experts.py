"""The mock engine's MoE routing: which experts each token was routed to (router replay).

vLLM served with ``--enable-return-routed-experts`` adds ``routed_experts`` (``[tokens]
[layers][top_k]`` expert ids) to every choice and ``prompt_routed_experts`` to the
response; SGLang does so for requests with ``return_routed_experts``. The mock answers
either way (``EngineConfig.routed_experts``, or the request field), for chat and
completions, with a routing that is a pure function of the token id and its layer, so a
test can check every stored id.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

LAYERS = 2
TOP_K = 2
EXPERTS = 16


def route(token_ids: Sequence[int]) -> list[list[list[int]]]:
    """Each token's experts: ``[(token + 7 * layer + 3 * slot) % 16 for each slot]``."""
    return [[[(t + 7 * layer + 3 * slot) % EXPERTS for slot in range(TOP_K)]
             for layer in range(LAYERS)] for t in token_ids]


def add(message: dict[str, Any], prompt_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """A body or chunk with each choice's routing (from its ``token_ids``) added."""
    for choice in message.get("choices") or ():
        ids = choice.get("token_ids")
        if ids is not None:
            choice["routed_experts"] = route(ids)
    if prompt_ids is not None:
        message["prompt_routed_experts"] = route(prompt_ids)
    return message


def chunks(stream: Iterator[dict]) -> Iterator[dict]:
    return (add(chunk) for chunk in stream)


def wanted(config: Any, req: Any) -> bool:
    return bool(getattr(config, "routed_experts", False) or req.return_routed_experts)
