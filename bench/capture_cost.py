"""What capture costs per request, step by step, in CPU microseconds (no network).

    python bench/capture_cost.py              # ~20 s; needs the local Postgres

proxy_bench.py measures tracetap's CPU per request against a bare relay's. This splits
what tracetap does on top of relaying into its steps, run on the very replies the bench
upstream sends (64 tokens; the client asks for nothing, so tracetap injects logprobs,
token ids and the usage chunk, and strips them again), non-streaming and streaming.
Each step is timed by process CPU over many repetitions; the database step is
storage.rows.insert_calls in batches of 256 (the writer's batch), per record.

The sum is the floor of tracetap's extra CPU per request with today's design: at
saturation, throughput relative to the relay is at most relay_cpu / (relay_cpu + sum).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
from pgtemp import create_database, drop_database
from upstream import BODIES, STREAMS

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tracetap.migrations import upgrade  # noqa: E402
from tracetap.proxy.apis.fields import RequestFields  # noqa: E402
from tracetap.proxy.apis.registry import readers  # noqa: E402
from tracetap.proxy.apis.routing import Routing  # noqa: E402
from tracetap.proxy.call.driver import ModelCall  # noqa: E402
from tracetap.proxy.call.record import call_outcome, call_record  # noqa: E402
from tracetap.proxy.episodes.arrivals import Arrivals  # noqa: E402
from tracetap.proxy.episodes.ids import uuid7  # noqa: E402
from tracetap.proxy.episodes.model_map import ModelMap  # noqa: E402
from tracetap.proxy.episodes.repair import Repair  # noqa: E402
from tracetap.proxy.runtime.metrics import Metrics  # noqa: E402
from tracetap.proxy.tokens.prompt_prefix import PromptPrefixes  # noqa: E402
from tracetap.storage.engine import create_engine  # noqa: E402
from tracetap.storage.journal import Journal  # noqa: E402
from tracetap.storage.rows import insert_calls  # noqa: E402
from tracetap.storage.writer import Writer  # noqa: E402

BATCH = 256
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write a short poem about the sea."},
]


def _state() -> SimpleNamespace:
    """The parts of ProxyState that a ModelCall touches."""
    return SimpleNamespace(
        flavor="vllm",
        instance="bench",
        arrivals=Arrivals(),
        metrics=Metrics(),
        model_map=ModelMap(),
        repair=Repair(False),
        routing=Routing("auto", native={}),
        prompt_prefixes=PromptPrefixes(),
        request_fields=RequestFields(),
        routed_experts=False,
        readers=readers(),
        submit=lambda record, *rest: None,
    )  # journaling is a step of its own


CHAT = Routing("auto", native={}).route("/v1/chat/completions", "vllm")


def _request(stream: bool) -> bytes:
    return msgspec.json.encode(
        {"model": "bench-model", "messages": MESSAGES, "max_tokens": 64, "stream": stream}
    )


def _replied(stream: bool) -> ModelCall:
    """A call that has parsed its request and seen the whole reply."""
    call = ModelCall(_state(), CHAT, uuid7())
    call.parse_request(_request(stream))
    call.sending()
    call.replied("http://bench", 200)
    if stream:
        relay = call.start_relay()
        for _ in relay.chunk(b"".join(STREAMS[True, True, True])):
            pass
        relay.end()
    else:
        call.reply_body(BODIES[True, True])
    return call


def _cpu_us(step, repeat: int) -> float:
    step()  # warm
    started = time.process_time()
    for _ in range(repeat):
        step()
    return (time.process_time() - started) / repeat * 1e6


def _steps(stream: bool, journal: Journal, repeat: int) -> dict[str, float]:
    state = _state()
    body = _request(stream)
    # One read per event, as the upstream writes them; [DONE] left out, as it journals.
    events = STREAMS[True, True, True][:-1]

    def request() -> None:
        ModelCall(state, CHAT, uuid7()).parse_request(body)

    def reply() -> None:
        call = ModelCall(state, CHAT, "x")
        call.parse_request(body)
        call.replied("http://bench", 200)
        if stream:
            relay = call.start_relay()
            for data in events:
                for _ in relay.chunk(data):
                    pass
        else:
            call.reply_body(BODIES[True, True])

    replied = _replied(stream)
    record = call_record(replied)
    return {
        "uuid7 call id": _cpu_us(uuid7, repeat),
        "request: decode, inject, encode": _cpu_us(request, repeat)
        - _cpu_us(lambda: ModelCall(state, CHAT, uuid7()), repeat),
        "reply: parse + capture + strip" + (" (65 events)" if stream else ""): _cpu_us(
            reply, repeat
        )
        - _cpu_us(lambda: ModelCall(state, CHAT, "x").parse_request(body), repeat),
        "record: build" + (" + reassemble" if stream else ""): _cpu_us(
            lambda: call_record(replied), repeat
        ),
        "journal: encode + write(2)": _cpu_us(
            lambda: journal.append(Writer.encode(record)), repeat
        ),
        "metrics": _cpu_us(
            lambda: state.metrics.observe_call(call_outcome(replied, 0.01)), repeat
        ),
    }


async def _insert_cpu(url: str, stream: bool, batches: int) -> float:
    engine = create_engine(url)
    template = call_record(_replied(stream))
    try:
        records = [
            [msgspec.structs.replace(template, call_id=uuid7(), seq=i) for i in range(BATCH)]
            for _ in range(batches + 1)
        ]
        # Warm: connection, prepared statements.
        await insert_calls(engine, records[0], readers=readers())
        started = time.process_time()
        for batch in records[1:]:
            await insert_calls(engine, batch, readers=readers())
        return (time.process_time() - started) / (batches * BATCH) * 1e6
    finally:
        await engine.dispose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--batches", type=int, default=20)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tracetap-capture-cost-"))
    journal = Journal(work / "journal", max_bytes=64 << 30, segment_bytes=1 << 40)
    table = {stream: _steps(stream, journal, args.repeat) for stream in (False, True)}
    sqlite = f"sqlite:///{work / 'cost.db'}"
    upgrade(sqlite)
    postgres = create_database()
    try:
        upgrade(postgres)
        for stream in (False, True):
            table[stream]["database: insert (Postgres)"] = asyncio.run(
                _insert_cpu(postgres, stream, args.batches)
            )
            table[stream]["database: insert (SQLite)"] = asyncio.run(
                _insert_cpu(sqlite, stream, args.batches)
            )
    finally:
        drop_database(postgres)
    print(f"{'CPU microseconds per request':44s} {'non-stream':>10s} {'stream':>10s}")
    for step in table[False]:
        label = step.replace(" (65 events)", "")
        stream_key = next(k for k in table[True] if k.startswith(label.split(" +")[0]))
        print(f"{label:44s} {table[False][step]:10.1f} {table[True][stream_key]:10.1f}")
    for backend in ("Postgres", "SQLite"):
        other = "SQLite" if backend == "Postgres" else "Postgres"
        total = {s: sum(v for k, v in table[s].items() if other not in k) for s in table}
        print(f"{'total, storing in ' + backend:44s} {total[False]:10.1f} {total[True]:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
