"""The proxy's admin API as the runner uses it: register, read and finish episodes.
The one place ``tracetap run`` speaks HTTP, so it works against any proxy or replica."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlencode

import aiohttp
import msgspec


class AdminError(RuntimeError):
    """The admin API refused or could not be reached (after retries)."""


class PatchesUnavailable(AdminError):
    """The proxy runs no patch at all now (no sandbox, or its cap of workers reached):
    the operator's to fix, never a candidate's fault."""


class Harness(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    config: dict[str, Any] | None = None


class Registration(msgspec.Struct, omit_defaults=True):
    id: str
    group_id: str | None = None
    task_id: str | None = None
    harness: Harness | None = None
    metadata: dict[str, Any] | None = None
    overlay: str | None = None  # an overlay loaded at start or installed (docs/overlays.md)


class Registered(msgspec.Struct):
    id: str
    base_url: str
    api_key: str


class Finish(msgspec.Struct, omit_defaults=True):
    reward: float | None = None
    rewards: dict[str, float] | None = None
    outcome: str | None = None
    info: dict[str, Any] | None = None


class EpisodeState(msgspec.Struct):
    """What a rerun needs to know of an episode it may have run before."""

    id: str
    finished_at: float | None = None
    reward: float | None = None
    outcome: str | None = None
    info: dict[str, Any] | None = None


class PriorConfig(msgspec.Struct):
    task_id: str | None
    config: Any
    episodes: int


class PriorConfigs(msgspec.Struct):
    """GET /tracetap/harness-configs: the (task, config) pairs a harness already ran."""

    harness: str
    before: float | None
    data: list[PriorConfig]


_registered = msgspec.json.Decoder(Registered).decode
_prior = msgspec.json.Decoder(PriorConfigs).decode
_state = msgspec.json.Decoder(EpisodeState).decode
_RETRIES = (0.5, 1.0, 2.0)  # seconds between tries when the proxy is unreachable


class AdminClient:
    """One pooled HTTP session to the proxy's admin API; close it with ``close``."""

    def __init__(self, proxy_url: str, token: str, *, timeout: float = 30.0):
        self.url = proxy_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout))

    async def close(self) -> None:
        await self._session.close()

    async def register(self, spec: Registration) -> Registered | None:
        """The episode's base URL and key; None when the id is taken (a retried request
        whose first try was stored: its key is lost, so the caller moves past it)."""
        status, body = await self._call("POST", "/tracetap/episodes", spec)
        if status == 409:
            return None
        if status != 201:
            raise AdminError(f"registering {spec.id}: HTTP {status}: {_said(body)}")
        return _registered(body)

    async def episode(self, episode_id: str) -> EpisodeState | None:
        status, body = await self._call("GET", f"/tracetap/episodes/{episode_id}")
        if status == 404:
            return None
        if status != 200:
            raise AdminError(f"reading {episode_id}: HTTP {status}: {_said(body)}")
        return _state(body)

    async def harness_configs(self, harness: str, exclude_prefix: str) -> PriorConfigs:
        query = urlencode({"harness": harness, "exclude_prefix": exclude_prefix})
        status, body = await self._call("GET", f"/tracetap/harness-configs?{query}")
        if status != 200:
            raise AdminError(f"reading what harness {harness!r} ran: HTTP {status}: {_said(body)}")
        return _prior(body)

    async def finish(self, episode_id: str, finish: Finish) -> None:
        status, body = await self._call("POST", f"/tracetap/episodes/{episode_id}/finish", finish)
        if status != 200:
            raise AdminError(f"finishing {episode_id}: HTTP {status}: {_said(body)}")

    async def install_overlay(self, name: str, source: str) -> dict[str, Any]:
        """``PUT /tracetap/overlays/NAME``: the patch, loaded and stored by the proxy (the
        same source again is accepted as it is)."""
        status, body = await self._call("PUT", f"/tracetap/overlays/{name}", {"source": source})
        if status == 503:
            raise PatchesUnavailable(f"installing overlay {name}: {_said(body)}")
        if status not in (200, 201):
            raise AdminError(f"installing overlay {name}: HTTP {status}: {_said(body)}")
        return msgspec.json.decode(body)

    async def delete_overlay(self, name: str) -> None:
        """``DELETE /tracetap/overlays/NAME`` (one already gone is fine): its worker ends."""
        status, body = await self._call("DELETE", f"/tracetap/overlays/{name}")
        if status not in (200, 404):
            raise AdminError(f"deleting overlay {name}: HTTP {status}: {_said(body)}")

    async def replay_overlay(self, name: str, episode_id: str, budget: float) -> str | None:
        """The patch's hooks on the episode's recorded calls, in the proxy's sandbox: None
        when every one ran within ``budget`` seconds, else why not."""
        status, body = await self._call(
            "POST", f"/tracetap/overlays/{name}/replay", {"episode": episode_id, "budget": budget}
        )
        if status == 503:
            raise PatchesUnavailable(f"replaying overlay {name}: {_said(body)}")
        if status != 200:
            raise AdminError(f"replaying overlay {name}: HTTP {status}: {_said(body)}")
        return msgspec.json.decode(body)["why"]

    async def _call(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        data = None if body is None else msgspec.json.encode(body)
        for pause in (*_RETRIES, None):
            try:
                async with self._session.request(
                    method, self.url + path, data=data, headers=self._headers
                ) as response:
                    return response.status, await response.read()
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                if pause is None:
                    raise AdminError(f"{method} {self.url}{path}: {exc!r}") from None
                await asyncio.sleep(pause)
        raise AssertionError("unreachable")


def _said(body: bytes) -> str:
    try:
        return msgspec.json.decode(body)["error"]["message"]
    except Exception:  # not the admin API's error shape: show the start of the body
        return body[:200].decode(errors="replace")
