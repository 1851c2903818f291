"""Load generation for the proxy benchmark: targets, requests, samples, /metrics scrapes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

JSON = {"Content-Type": "application/json"}
MESSAGES = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "List sixty-four words, one per line, and stop."}]
TICKS = os.sysconf("SC_CLK_TCK")
SCENARIOS = ("c1", "c1_stream", "c32", "c32_stream")


_PATHS = {"chat": "/chat/completions", "responses": "/responses", "messages": "/messages"}
# The last event of a complete stream, per API (Responses: cut at max_output_tokens is
# "incomplete", which is still a whole stream).
_STREAM_END = {"chat": (b"data: [DONE]",), "messages": (b"message_stop",),
               "responses": (b"event: response.completed", b"event: response.incomplete")}


@dataclass
class Target:
    name: str
    base: str  # the origin the client talks to
    episode_path: bool = False  # tracetap: tag calls by /episodes/<id>/v1
    process: subprocess.Popen | None = None
    metrics: bool = False
    api: str = "chat"  # the wire API the client speaks (tracetap translates to chat)

    def url(self, worker: int) -> str:
        prefix = f"/episodes/bench-{worker}/v1" if self.episode_path else "/v1"
        return f"{self.base}{prefix}{_PATHS[self.api]}"

    def rss_mib(self) -> float:
        """Of the process and its children (``serve --workers N``: the workers)."""
        total = 0
        for pid in _tree(self.process.pid):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        return total / 1024

    def cpu_seconds(self) -> float:
        if self.process is None:
            return 0.0
        total = 0
        for pid in _tree(self.process.pid):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
        return total / TICKS


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants, living ones only."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except FileNotFoundError:
        return []
    return [pid, *(p for child in children for p in _tree(int(child)))]


@dataclass
class Sample:
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    overheads: list[float] = field(default_factory=list)  # tracetap's own header, seconds
    blocks: list[float] = field(default_factory=list)  # c1: each block's median (latency/TTFT)
    errors: int = 0
    done: int = 0
    elapsed: float = 0.0
    cpu: float = 0.0  # seconds of the target's own process
    upstream_cpu: float = 0.0

    def merge(self, other: Sample) -> None:
        self.latencies += other.latencies
        self.ttfts += other.ttfts
        self.overheads += other.overheads
        self.blocks += other.blocks
        self.errors += other.errors
        self.done += other.done
        self.elapsed += other.elapsed
        self.cpu += other.cpu
        self.upstream_cpu += other.upstream_cpu


def request_body(stream: bool, client: str, api: str = "chat") -> bytes:
    if api == "responses":
        return msgspec.json.encode({"model": "bench-model", "instructions": MESSAGES[0]["content"],
                                    "input": MESSAGES[1:], "max_output_tokens": 64,
                                    "stream": stream, "store": False})
    if api == "messages":
        return msgspec.json.encode({"model": "bench-model", "system": MESSAGES[0]["content"],
                                    "messages": MESSAGES[1:], "max_tokens": 64,
                                    "stream": stream})
    body: dict = {"model": "bench-model", "messages": MESSAGES, "max_tokens": 64,
                  "stream": stream}
    if client == "rl":  # a harness that asks for everything capture needs itself
        body |= {"logprobs": True, "top_logprobs": 0, "return_token_ids": True}
        if stream:
            body["stream_options"] = {"include_usage": True}
    return msgspec.json.encode(body)


async def one(session: aiohttp.ClientSession, url: str, body: bytes, stream: bool,
              sample: Sample, end: tuple[bytes, ...] = _STREAM_END["chat"]) -> bytes:
    started = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=JSON) as resp:
            if stream:
                first, parts = None, []
                async for data in resp.content.iter_any():
                    if first is None:
                        first = time.perf_counter()
                    parts.append(data)
                data = b"".join(parts)
                last = data[data.rfind(b"\n\n", 0, len(data) - 2):]  # the last event
                ok = resp.status == 200 and any(marker in last for marker in end)
            else:
                data = await resp.read()
                ok = resp.status == 200 and data.startswith(b"{")
                overhead = resp.headers.get("x-tracetap-overhead-ms")
                if overhead is not None:
                    sample.overheads.append(float(overhead) / 1000)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        sample.errors += 1
        return b""
    if not ok:
        sample.errors += 1
        return data
    sample.latencies.append(time.perf_counter() - started)
    if stream:
        sample.ttfts.append(first - started)
    sample.done += 1
    return data


async def load(session: aiohttp.ClientSession, target: Target, body: bytes, stream: bool,
               concurrency: int, *, count: int | None = None,
               seconds: float | None = None) -> Sample:
    sample = Sample()
    issued = 0
    deadline = None if seconds is None else time.perf_counter() + seconds

    async def worker(w: int) -> None:
        nonlocal issued
        url = target.url(w)
        while True:
            if count is not None:
                if issued >= count:
                    return
                issued += 1
            elif time.perf_counter() >= deadline:
                return
            await one(session, url, body, stream, sample, _STREAM_END[target.api])

    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    sample.elapsed = time.perf_counter() - started
    return sample


async def scrape(session: aiohttp.ClientSession, target: Target) -> dict[str, float]:
    async with session.get(target.base + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()))
            out[key] = s.value
    return out


async def poll_queue(session: aiohttp.ClientSession, target: Target, peak: list[float],
                     interval: float = 0.1) -> None:
    while True:
        metrics = await scrape(session, target)
        peak[0] = max(peak[0], metrics.get("tracetap_capture_queue_depth", 0.0))
        await asyncio.sleep(interval)


@dataclass
class Report:
    samples: dict[str, Sample] = field(default_factory=lambda: {s: Sample() for s in SCENARIOS})
    sent: int = 0
    queue_peak: float = 0.0
    rss_warm: float = 0.0
    rss_after: float = 0.0
    identical: bool | None = None
    idle_ms_s: float | None = None  # CPU ms per second while serving nothing


async def interleaved(session: aiohttp.ClientSession, targets: list[Target],
                      reports: dict[str, Report], scenario: str, stream: bool, count: int,
                      client: str, block: int = 25, warm: int = 2) -> None:
    """c=1 in short blocks per target, the order rotating each block, so every target
    sees the same machine. The pause after a block lets that target's background work
    (the writer's commit) finish on its own time rather than on the next target's; the
    first ``warm`` requests of a block are not counted, as the pause lets the processes
    involved go cold (idle CPUs, caches), more of them the more processes a path has."""
    samples = {t.name: Sample() for t in targets}
    warmups = {t.name: Sample() for t in targets}
    for b in range(-(-count // block)):
        shift = b % len(targets)
        for t in targets[shift:] + targets[:shift]:
            sample = Sample()
            body, end = request_body(stream, client, t.api), _STREAM_END[t.api]
            for _ in range(warm):
                await one(session, t.url(0), body, stream, warmups[t.name], end)
            cpu = t.cpu_seconds()
            for _ in range(min(block, count - b * block)):
                await one(session, t.url(0), body, stream, sample, end)
            await asyncio.sleep(0.1)
            sample.cpu = t.cpu_seconds() - cpu  # the pause included: background work counts
            timings = sorted(sample.ttfts if stream else sample.latencies)
            if timings:
                sample.blocks.append(timings[len(timings) // 2])
            samples[t.name].merge(sample)
    for t in targets:
        samples[t.name].errors += warmups[t.name].errors
        reports[t.name].samples[scenario].merge(samples[t.name])
        reports[t.name].sent += (samples[t.name].done + warmups[t.name].done
                                 + samples[t.name].errors)


async def saturate(session: aiohttp.ClientSession, target: Target, upstream: Target,
                   report: Report, scenario: str, stream: bool, seconds: float,
                   client: str) -> None:
    """c=32 for ``seconds``; the target's and the upstream's CPU time are read around it."""
    poller = None
    peak = [0.0]
    if target.metrics:
        poller = asyncio.create_task(poll_queue(session, target, peak))
    cpu0, up0 = target.cpu_seconds(), upstream.cpu_seconds()
    sample = await load(session, target, request_body(stream, client, target.api), stream, 32,
                        seconds=seconds)
    sample.cpu, sample.upstream_cpu = target.cpu_seconds() - cpu0, upstream.cpu_seconds() - up0
    if poller is not None:
        poller.cancel()
        report.queue_peak = max(report.queue_peak, peak[0])
    report.samples[scenario].merge(sample)
    report.sent += sample.done + sample.errors


async def warm_up(session: aiohttp.ClientSession, target: Target, report: Report,
                  reference: dict[tuple[str, bool], bytes], client: str) -> None:
    for stream in (False, True):
        body = request_body(stream, client, target.api)
        sample = await load(session, target, body, stream, 8, count=200)
        report.sent += sample.done + sample.errors
        data = await one(session, target.url(0), body, stream, Sample(),
                         _STREAM_END[target.api])
        report.sent += 1
        if stream:  # chunk boundaries may differ: compare the events
            data = data.replace(b"\r\n", b"\n")
        if target.api != "chat":  # translated: ids and timestamps differ by design
            report.identical = None
            continue
        key = (target.api, stream)
        if key not in reference:
            reference[key] = data
        report.identical = (report.identical is not False) and data == reference[key]


async def drain(session: aiohttp.ClientSession, target: Target, sent: int,
                timeout: float = 60.0) -> dict[str, float]:
    """Wait until every captured call is committed; return the final metrics."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = await scrape(session, target)
        done = (metrics.get("tracetap_records_total,outcome=written", 0)
                + metrics.get("tracetap_records_total,outcome=dropped", 0))
        if (metrics.get("tracetap_capture_queue_depth", 1) == 0 and done >= sent) \
                or time.monotonic() > deadline:
            return metrics
        await asyncio.sleep(0.2)
