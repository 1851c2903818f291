"""A bounded soak: 64 concurrent streaming agents for 30 seconds (TRACETAP_SOAK_SECONDS).

Zero errors, zero lost records, and the proxy's RSS at the end within 50 MiB of its RSS
after warm-up. Slow, but part of CI.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import openai
import pytest
from helpers.http import metrics_text, wait_ready
from helpers.loop import free_port
from helpers.servers import stored_calls

from tracetap.migrations import upgrade

SECONDS = float(os.environ.get("TRACETAP_SOAK_SECONDS", "30"))
CLIENTS = 64
EPISODES = 16


@pytest.fixture
def engine_process(tmp_path):
    port = free_port()
    log = open(tmp_path / "engine.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen([sys.executable, "-m", "tracetap", "mock-engine", "--port",
                                str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/health", process, what="mock-engine")
    yield url + "/v1"
    process.terminate()
    process.wait(10)
    log.close()


@pytest.mark.slow
def test_soak_64_streaming_clients(engine_process, fresh_postgres, run_proxy):
    upgrade(fresh_postgres)
    proxy = run_proxy(engine_process, fresh_postgres)
    errors: list[BaseException] = []
    completed = [0]
    rss = {}

    async def agent(n: int, client: openai.AsyncOpenAI, until: float) -> None:
        i = 0
        while time.monotonic() < until:
            episode = f"soak-{n % EPISODES}"
            try:
                stream = await client.chat.completions.create(
                    model="mock-model", stream=True, max_tokens=32,
                    messages=[{"role": "user", "content": f"agent {n} turn {i}"}],
                    extra_headers={"X-Tracetap-Episode": episode})
                finish = None
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                assert finish is not None
                completed[0] += 1
            except Exception as exc:  # every error the agent sees fails the soak
                errors.append(exc)
            i += 1

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        async with client:
            start = time.monotonic()
            warmup = start + min(10.0, SECONDS / 6)
            until = start + SECONDS
            agents = [asyncio.create_task(agent(n, client, until)) for n in range(CLIENTS)]
            await asyncio.sleep(warmup - time.monotonic())
            rss["warm"] = proxy.rss_bytes()
            await asyncio.gather(*agents)
            rss["end"] = proxy.rss_bytes()

    asyncio.run(run())
    metrics = metrics_text(proxy.url)
    proxy.stop()
    stored = sum(len(stored_calls(fresh_postgres, f"soak-{e}")) for e in range(EPISODES))
    growth = (rss["end"] - rss["warm"]) / 2**20
    print(f"\nsoak: {SECONDS:.0f}s, {CLIENTS} clients, {completed[0]} calls "
          f"({completed[0] / SECONDS:.0f}/s), errors={len(errors)}, stored={stored}, "
          f"rss warm={rss['warm'] / 2**20:.1f} MiB end={rss['end'] / 2**20:.1f} MiB "
          f"growth={growth:.1f} MiB")
    assert errors == []
    assert completed[0] > 0 and stored == completed[0]
    assert 'tracetap_records_total{outcome="dropped"} 0.0' in metrics
    assert growth < 50
