"""Token ids to their text, asked of the engine itself (its ``/detokenize``), cached.

tracetap stores ids, not token strings, and has no tokenizer of its own: the engine that
produced the ids is the one authority on what they say. vLLM, SGLang and llama.cpp's
server (and the mock engine) answer ``POST /detokenize {"tokens": [id]}``, one id at a
time here so each token gets its own text (a partial UTF-8 byte shows as U+FFFD). Only
ids on the page being drawn are asked for, each once per process. Without an engine, or
when it does not answer, tokens are shown by id.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable

import aiohttp

from tracetap.storage.config import redact_credentials

log = logging.getLogger("tracetap.viewer")

CACHE_SIZE = 500_000
CONCURRENCY = 16
MAX_PER_PAGE = 4096  # ids asked for one page at most; the rest show their id
RETRY_AFTER_S = 30.0  # after a failure, the engine is not asked again before this


def engine_root(url: str) -> str:
    """``http://host:8000/v1`` → ``http://host:8000`` (/detokenize is at the engine root)."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


class Detokenizer:
    def __init__(self, url: str | None, api_key: str | None = None, timeout: float = 5.0):
        self.url = None if url is None else engine_root(url) + "/detokenize"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.cache: OrderedDict[int, str] = OrderedDict()
        self.session: aiohttp.ClientSession | None = None
        self.down_until = 0.0

    async def start(self) -> None:
        if self.url is not None:
            self.session = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    @property
    def available(self) -> bool:
        return self.session is not None and time.monotonic() >= self.down_until

    async def texts(self, ids: Iterable[int]) -> dict[int, str]:
        """Text of each id that is known or can be learned now; the rest are left out."""
        unique = set(ids)
        known = {i: self.cache[i] for i in unique if i in self.cache}
        for i in known:
            self.cache.move_to_end(i)
        missing = sorted(unique - known.keys())[:MAX_PER_PAGE]
        if missing and self.available:
            gate = asyncio.Semaphore(CONCURRENCY)
            results = await asyncio.gather(*(self._one(i, gate) for i in missing))
            for i, text in zip(missing, results):
                if text is not None:
                    known[i] = text
                    self.cache[i] = text
            while len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        return known

    async def _one(self, token_id: int, gate: asyncio.Semaphore) -> str | None:
        if not self.available:
            return None
        async with gate:
            try:
                async with self.session.post(self.url, json={"tokens": [token_id]}) as reply:
                    if reply.status != 200:
                        raise aiohttp.ClientError(f"HTTP {reply.status}")
                    body = await reply.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                if self.available:
                    log.warning("token text unavailable: %s answered %s; showing ids",
                                redact_credentials(self.url), exc or type(exc).__name__)
                self.down_until = time.monotonic() + RETRY_AFTER_S
                return None
        text = None
        if isinstance(body, dict):  # vLLM's, llama-server's, SGLang's key
            text = body.get("prompt", body.get("content", body.get("text")))
        return text if isinstance(text, str) else None
