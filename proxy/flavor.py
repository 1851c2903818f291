"""Which kind of engine the upstream is, so the proxy only asks for what it supports."""

from __future__ import annotations

import asyncio
import logging

from proxy.upstream import Upstream

log = logging.getLogger("tracetap.flavor")
_OWNERS = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp", "llama.cpp": "llamacpp"}


async def detect(upstream: Upstream) -> str | None:
    """Guess from ``/v1/models`` owners or vLLM's ``/version``; None if unreachable."""
    models = await upstream.get_json("/v1/models")
    if isinstance(models, dict):
        for model in models.get("data") or ():
            owner = str(model.get("owned_by", "")).lower() if isinstance(model, dict) else ""
            if owner in _OWNERS:
                return _OWNERS[owner]
    version = await upstream.get_json("/version")
    if isinstance(version, dict) and "version" in version:
        return "vllm"
    return "openai" if models is not None else None


async def keep_detecting(upstream: Upstream, apply, interval: float = 5.0) -> None:
    """Retry until the upstream answers (it may start after the proxy)."""
    while True:
        flavor = await detect(upstream)
        if flavor is not None:
            apply(flavor)
            log.info("upstream flavor: %s", flavor)
            return
        await asyncio.sleep(interval)
