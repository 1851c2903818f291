"""Which kind of engine the upstream is, so the proxy only asks for what it supports."""

from __future__ import annotations

import asyncio
import logging

from tracetap.proxy.upstream.client import UpstreamClient
from tracetap.proxy.upstream.pool import Target

log = logging.getLogger("tracetap.flavor")
_OWNERS = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp", "llama.cpp": "llamacpp"}


class Flavor:
    """The upstream's kind as the proxy knows it now: ``--upstream-flavor``, or, with
    ``auto``, "openai" until detection finds it (once, maybe after the start). One per
    process; the routing, the capture and the token resolver read it."""

    def __init__(self, configured: str):
        self.name = "openai" if configured == "auto" else configured

    def __call__(self) -> str:
        return self.name

    def found(self, name: str) -> None:
        self.name = name


async def detect(client: UpstreamClient, target: Target) -> str | None:
    """Guess from ``/v1/models`` owners, SGLang's ``/get_model_info`` or vLLM's
    ``/version``; None if unreachable.
    Asked only while no call is in flight to it (llama-cpp-python would cut a stream)."""
    async with target.traffic.window():
        return await _ask(client, target)


async def _ask(client: UpstreamClient, target: Target) -> str | None:
    models = await client.get_json(target.url_for("/v1/models"))
    if isinstance(models, dict):
        for model in models.get("data") or ():
            owner = str(model.get("owned_by", "")).lower() if isinstance(model, dict) else ""
            if owner in _OWNERS:
                return _OWNERS[owner]
    # SGLang (0.5.23 http_server.py) answers this under both names, whatever a gateway
    # in front of it says of the models' owner; nothing else has it.
    info = await client.get_json(target.url_for("/get_model_info"))
    if isinstance(info, dict) and "model_path" in info and "is_generation" in info:
        return "sglang"
    version = await client.get_json(target.url_for("/version"))
    if isinstance(version, dict) and "version" in version:
        return "vllm"
    return "openai" if models is not None else None


async def keep_detecting(client: UpstreamClient, target: Target, apply,
                         interval: float = 5.0) -> None:
    """Retry until the upstream answers (it may start after the proxy)."""
    while True:
        flavor = await detect(client, target)
        if flavor is not None:
            apply(flavor)
            log.info("upstream flavor: %s", flavor)
            return
        await asyncio.sleep(interval)
