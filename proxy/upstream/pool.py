"""Several model servers behind one proxy: affinity, load, health and failover.

An episode's calls stick to one upstream (rendezvous hashing of the episode id, stable
across proxy replicas) so the engine's prefix cache is reused; untagged calls go to the
least-loaded upstream. An upstream that refuses connections or fails its health check
is taken out and probed until it answers again; its episodes move meanwhile.

A call counts as in flight to its target from before it is sent until its reply is
closed (``Target.traffic``): tracetap's own requests to an upstream (health probes here,
tokenizer questions in proxy.tokens.resolve) never reach it while a call is in flight, because
llama-cpp-python ends a stream whenever another request arrives.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from urllib.parse import urlsplit

from tracetap.proxy.upstream.client import ConnectFailed, Reply, UpstreamClient
from tracetap.proxy.upstream.specs import UpstreamSpec
from tracetap.proxy.upstream.traffic import Traffic

log = logging.getLogger("tracetap.pool")


class Target:
    def __init__(self, spec: UpstreamSpec):
        # Shown, logged, stored and labelled: credentials in the URL are masked. Requests
        # go to the URL as given (the HTTP client turns user:password@ into Basic auth).
        self.base_url = spec.shown.rstrip("/")
        self._url = spec.url.rstrip("/")
        self.model = spec.model
        parts = urlsplit(self._url)
        self.origin = f"{parts.scheme}://{parts.netloc}"
        self.healthy = True
        self.traffic = Traffic()

    @property
    def inflight(self) -> int:
        return self.traffic.inflight

    def url_for(self, path_qs: str) -> str:
        """Client path → upstream URL: ``/v1/x`` maps under the base URL, others to its origin."""
        if path_qs == "/v1" or path_qs.startswith(("/v1/", "/v1?")):
            return self._url + path_qs[3:]
        return self.origin + path_qs

    def finished(self) -> None:
        self.traffic.release()

    def weight(self, key: str) -> int:
        digest = hashlib.blake2b(f"{key}|{self.base_url}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")


class Pool:
    def __init__(
        self, specs: list[UpstreamSpec], client: UpstreamClient, *, health_interval: float = 5.0
    ):
        self.targets = [Target(spec) for spec in specs]
        self.client = client
        self.health_interval = health_interval

    @property
    def primary(self) -> Target:
        return self.targets[0]

    def candidates(self, episode_id: str | None, model: str | None) -> list[Target]:
        """Targets to try, best first: healthy ones, then the rest as a last resort."""
        if len(self.targets) == 1:
            return self.targets  # one upstream: no hashing or sorting on every call
        pool = [t for t in self.targets if model is not None and t.model == model]
        if not pool:
            pool = [t for t in self.targets if t.model is None] or self.targets
        if episode_id is not None:
            ordered = sorted(pool, key=lambda t: t.weight(episode_id), reverse=True)
        else:
            ordered = sorted(pool, key=lambda t: t.inflight)
        return [t for t in ordered if t.healthy] + [t for t in ordered if not t.healthy]

    async def send(
        self,
        method: str,
        path_qs: str,
        headers: dict[str, str],
        body,
        *,
        episode_id: str | None = None,
        model: str | None = None,
        retry: bool = True,
    ) -> tuple[Target, Reply]:
        """Send to the best target; move on to the next only when nothing was sent."""
        candidates = self.candidates(episode_id, model)
        for attempt, target in enumerate(candidates):
            await target.traffic.admit()  # waits while tracetap asks this target something
            try:
                reply = await self.client.send(method, target.url_for(path_qs), headers, body)
            except ConnectFailed:
                target.finished()
                self.mark_down(target)
                if not retry or attempt == len(candidates) - 1:
                    raise
                continue
            except BaseException:
                target.finished()
                raise
            if not target.healthy:  # it answered: back in service, probe or no probe
                log.warning("upstream %s is back in service", target.base_url)
                target.healthy = True
            reply.on_close = target.finished
            return target, reply
        raise AssertionError("a pool always has a target")

    def mark_down(self, target: Target) -> None:
        if target.healthy:
            if len(self.targets) == 1:
                log.warning(
                    "upstream %s does not answer; calls fail until it does", target.base_url
                )
            else:
                log.warning(
                    "upstream %s does not answer; its episodes move to the others until it does",
                    target.base_url,
                )
        target.healthy = False

    def traffic(self, base_url: str) -> Traffic | None:
        """The traffic of the target a stored call went to (``CallRecord.upstream``)."""
        return next((t.traffic for t in self.targets if t.base_url == base_url), None)

    async def probe(self, target: Target) -> bool | None:
        """In service when it answers; a 404 is a wrong path (serve says so at start), not
        a server that is down. None (not asked) while a call to it is in flight: the call
        says more than a probe, and the probe could cut its stream."""
        async with target.traffic.try_window() as quiet:
            if not quiet:
                return None
            status = await self.client.status(target.url_for("/v1/models"))
        return status is not None and status < 500

    async def check_health(self) -> None:
        results = await asyncio.gather(*(self.probe(t) for t in self.targets))
        for target, ok in zip(self.targets, results):
            if ok is None:
                continue
            if ok and not target.healthy:
                log.warning("upstream %s is back in service", target.base_url)
            if not ok:
                self.mark_down(target)
            target.healthy = ok

    async def keep_checking(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await self.check_health()

    def address(self, shown: str) -> str:
        """The URL to reach an upstream that records name by its shown (masked) URL."""
        for target in self.targets:
            if target.base_url == shown:
                return target._url
        return shown

    def describe(self) -> list[dict]:
        return [
            {"url": t.base_url, "model": t.model, "healthy": t.healthy, "inflight": t.inflight}
            for t in self.targets
        ]
