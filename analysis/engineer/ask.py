"""The engineer model, called through a tracetap proxy: each candidate is an episode of
its own (group = the packet, or the batch of packets, it answers), so its tokens are
captured, its reward is Δ_B, and ``tracetap export`` gives the groups GRPO trains on."""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec

from tracetap.analysis.runner.admin import AdminClient, Harness, Registration


class Asked(msgspec.Struct, kw_only=True):
    episode_id: str
    group: str
    candidate: int
    reply: str | None  # the engineer's text (None: the call failed, see error)
    error: str | None = None
    existed: bool = False  # registered by an earlier run with this run id (not asked now)


async def ask(
    admin: AdminClient,
    *,
    episode_id: str,
    group: str,
    candidate: int,
    model: str,
    messages: list[dict[str, str]],
    metadata: dict[str, Any],
    max_tokens: int = 4096,
    scripted: str | None = None,
    timeout: float = 600.0,
) -> Asked:
    """Register the candidate's episode and ask the engineer once (seed = the candidate).
    ``scripted`` (the mock engine only) makes the engine answer exactly that text."""
    registered = await admin.register(
        Registration(
            id=episode_id,
            group_id=group,
            task_id=group,
            harness=Harness("engineer", {"model": model}),
            metadata=metadata,
        )
    )
    if registered is None:  # an earlier run's: resumed by the loop (engineer.resume)
        return Asked(
            episode_id=episode_id, group=group, candidate=candidate, reply=None, existed=True
        )
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "temperature": 1.0,
        "seed": candidate,
        "max_tokens": max_tokens,
    }
    if scripted is not None:
        body["mock_content"] = scripted
    headers = {"Authorization": f"Bearer {registered.api_key}"}
    url = registered.base_url.rstrip("/") + "/chat/completions"
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.post(url, json=body, headers=headers) as response,
        ):
            data = await response.json(content_type=None)
            if response.status != 200:
                return Asked(
                    episode_id=episode_id,
                    group=group,
                    candidate=candidate,
                    reply=None,
                    error=f"HTTP {response.status}: {data}",
                )
        reply = data["choices"][0]["message"].get("content")
    except (aiohttp.ClientError, TimeoutError, KeyError, IndexError, TypeError, ValueError) as exc:
        return Asked(
            episode_id=episode_id,
            group=group,
            candidate=candidate,
            reply=None,
            error=f"{type(exc).__name__}: {exc}",
        )
    return Asked(episode_id=episode_id, group=group, candidate=candidate, reply=reply)
