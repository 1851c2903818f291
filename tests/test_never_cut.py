"""No stream is ever cut by tracetap's own questions to the engine.

llama-cpp-python ends a stream as soon as any other request reaches it. The mock engine's
llama-cpp-python flavor does the same, so any question tracetap asked mid-stream (tokenize,
flavor or health probes) would show as a short stream. Records whose ids need the engine
wait, journaled and counted, until no call to it is in flight, however long that takes:
there is no timeout after which tracetap asks anyway.
"""

from __future__ import annotations

import asyncio
import json

import openai
from aiohttp import web
from helpers.http import fetch
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.demo import tokenizer as tok
from tracetap.demo.engine import EngineConfig, make_engine_app
from tracetap.proxy.episodes.ids import uuid7
from tracetap.proxy.runtime.settings import Settings
from tracetap.storage import queries
from tracetap.storage.engine import create_engine
from tracetap.storage.journal import Journal
from tracetap.storage.records import CallRecord, ChoiceRecord
from tracetap.storage.writer import Writer

STREAMED = "y" * 60


def _get(url: str) -> tuple[int, str]:
    status, body = fetch("GET", url, timeout=10)
    return status, body.decode()


def _waiting(proxy) -> float:
    _, text = _get(proxy.url + "/metrics")
    [line] = [x for x in text.splitlines()
              if x.startswith("tracetap_token_ids_waiting_records ")]
    return float(line.split()[1])


def test_a_stream_longer_than_every_internal_timer_is_whole_and_ids_come_after(
        loop_thread, db_url, tmp_path, serve_app):
    seen: list[tuple[int, str, float, float]] = []  # (engine, path, start, end)

    def engine(number: int) -> str:
        app = make_engine_app(EngineConfig(flavor="llama-cpp-python"))

        @web.middleware
        async def timed(request, handler):
            start = loop_thread.loop.time()
            try:
                return await handler(request)
            finally:
                seen.append((number, request.path, start, loop_thread.loop.time()))

        app.middlewares.append(timed)
        return serve_app(app) + "/v1"

    # Two upstreams, so /readyz has one busy and one idle upstream to look at.
    settings = Settings(upstream=[engine(0), engine(1)], db=db_url, port=free_port(),
                        data_dir=str(tmp_path / "data"))
    proxy = Proxy(loop_thread, settings).start()
    writer = proxy.state.writer
    # Every timer far shorter than the stream (~3 s): held records are offered again every
    # 20 ms and the writer flushes every 20 ms once woken.
    writer.hold_retry = 0.02
    writer.flush_interval = 3600.0  # the first record waits until the stream is under way
    loop_thread.run(asyncio.sleep(0.2))  # the writer's current wait ends
    try:
        client = openai.OpenAI(base_url=proxy.episode_url("long"), api_key="x", max_retries=0)
        with client:
            # A plain call first, whose ids need the engine's tokenizer; the episode keeps
            # both calls on one upstream.
            client.completions.create(model="m", prompt="First.")
            text, waited, ready = "", [], []
            stream = client.completions.create(
                model="m", prompt="Second.", stream=True,
                extra_body={"mock_content": STREAMED, "mock_chunk_delay_s": 0.05})
            for i, chunk in enumerate(stream):
                text += chunk.choices[0].text if chunk.choices else ""
                if i == 1:  # mid-stream: the writer takes up the first record now
                    writer.flush_interval = 0.02
                    loop_thread.loop.call_soon_threadsafe(writer._wake.set)
                if i % 10 == 5:
                    waited.append(_waiting(proxy))
                    ready.append(_get(proxy.url + "/readyz"))
        assert text == STREAMED  # whole: nothing asked the engine meanwhile
        calls = proxy.calls("long")
    finally:
        proxy.stop()
    [(used, _, start, end)] = [s for s in seen if s[1] == "/v1/completions" and s[3] - s[2] > 1]
    asked = [(path, t) for n, path, t, _ in seen if n == used and path != "/v1/completions"]
    assert asked and not [a for a in asked if start <= a[1] <= end], asked
    # The idle upstream was probed meanwhile; the busy one was left alone.
    assert [t for n, path, t, _ in seen if n != used and path == "/v1/models" and start <= t]
    # The first record waited through the stream, journaled and counted ...
    assert 1.0 in waited and all(status == 200 for status, _ in ready)
    assert [u["inflight"] for u in json.loads(ready[-1][1])["upstreams"]].count(1) == 1
    # ... and both got their ids once the stream was over.
    assert [c["prompt_ids"] for c in calls] == [tok.encode("First."), tok.encode("Second.")]
    assert [c["choices"][0]["token_source"] for c in calls] == ["verified_retokenized"] * 2
    assert calls[1]["choices"][0]["completion_ids"] == tok.encode(STREAMED)


def _record(i: int) -> CallRecord:
    return CallRecord(call_id=uuid7(), episode_id="held", seq=i, endpoint="completions",
                      t_start=float(i), status="ok", http_status=200, upstream="http://u/v1",
                      request=json.dumps({"prompt": "hi"}),
                      choices=[ChoiceRecord(index=0, text="ab", token_strs=["a", "b"])])


class Engine:
    """A prepare step whose engine is busy until ``idle``; what it could not ask is
    stored as engine_busy only when told not to hold."""

    def __init__(self) -> None:
        self.idle = False
        self.offers: list[tuple[int, bool]] = []

    async def __call__(self, records, hold=True):
        self.offers.append((len(records), hold))
        if self.idle:
            for r in records:
                r.prompt_ids, r.choices[0].completion_ids = [1, 2], [97, 98]
            return []
        if hold:
            return list(records)
        for r in records:
            r.ids_missing = "engine_busy"
        return []


def test_records_waiting_for_the_engine_survive_a_stop_and_are_resolved_after(
        db_url, tmp_path):
    async def run():
        engine = create_engine(db_url)
        busy = Engine()
        writer = Writer(engine, Journal(tmp_path / "j", max_bytes=1 << 20), prepare=busy,
                        hold_retry=0.0)
        for i in range(3):
            writer.submit(_record(i))
        await writer.flush()
        await writer.flush()  # offered again: still busy, still journaled, none stored
        held = (writer.held, writer.pending, await queries.calls_of(engine, "held"))
        await writer.close()  # the proxy stops while they wait
        restarted = Engine()
        restarted.idle = True
        again = Writer(engine, Journal(tmp_path / "j", max_bytes=1 << 20), prepare=restarted)
        await again.flush()
        stored = await queries.calls_of(engine, "held")
        left = (again.held, again.pending, again.journal.bytes)
        await again.close()
        await engine.dispose()
        return busy.offers, held, stored, left

    offers, (held, pending, stored_then), stored, left = asyncio.run(run())
    assert offers[:2] == [(3, True), (3, True)]
    assert (held, pending, stored_then) == (3, 3, [])
    assert [c["prompt_ids"] for c in stored] == [[1, 2]] * 3
    assert [c["choices"][0]["completion_ids"] for c in stored] == [[97, 98]] * 3
    assert left == (0, 0, 0)


def test_records_never_fill_more_than_half_the_journal_waiting(db_url, tmp_path):
    async def run():
        engine = create_engine(db_url)
        busy = Engine()
        size = len(Writer.encode(_record(0))) + 8
        writer = Writer(engine, Journal(tmp_path / "j", max_bytes=size * 4), prepare=busy,
                        hold_retry=0.0)
        for i in range(3):  # 3 of 4 records' room: over half, so nothing may wait
            writer.submit(_record(i))
        await writer.flush()
        stored = await queries.calls_of(engine, "held")
        await writer.close()
        await engine.dispose()
        return busy.offers, stored, writer.held

    offers, stored, held = asyncio.run(run())
    assert offers == [(3, False)] and held == 0
    assert [c["ids_missing"] for c in stored] == ["engine_busy"] * 3


def test_an_engine_of_unknown_kind_is_identified_at_start_so_its_records_never_wait(
        loop_thread, db_url, tmp_path, serve_app):
    """An OpenAI-compatible engine tracetap cannot name might be llama-cpp-python: its
    tokenizer endpoints are found at start, before any call, so a busy engine that turns
    out not to cut streams never holds records back."""
    upstream = serve_app(make_engine_app(EngineConfig(flavor="openai"))) + "/v1"
    settings = Settings(upstream=upstream, db=db_url, port=free_port(),
                        data_dir=str(tmp_path / "data"))
    proxy = Proxy(loop_thread, settings).start()
    try:
        client = openai.OpenAI(base_url=proxy.episode_url("busy"), api_key="x", max_retries=0)
        with client:
            stream = client.completions.create(
                model="m", prompt="Long.", stream=True,
                extra_body={"mock_content": "z" * 20, "mock_chunk_delay_s": 0.05})
            next(iter(stream))  # in flight from here on
            client.completions.create(model="m", prompt="Short.")
            [short] = proxy.calls("busy")  # stored at once, the stream still going
            held = proxy.state.writer.held
            text = "".join(c.choices[0].text for c in stream if c.choices)
    finally:
        proxy.stop()
    assert held == 0 and short["ids_missing"] == "no_tokenizer"
    assert text.endswith("z" * 10)
