"""What a call's intent costs (storage.intents) on a fresh Postgres database, one process.

    python bench/intents_bench.py                # ~20 s
    python bench/intents_bench.py --calls 2000

Two shapes: ``short`` calls answered at once, one after another (each answer's end waits
for its own intent, written from its admission: the cost a sub-millisecond call pays),
and ``in flight`` calls admitted N at a time that run 100 ms (their intents are written in
one batch while they run: what an LLM call pays, nothing at its end). Prints per call: the
wall time its answer waited, and the CPU of the whole process (the intent writer
included).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from pgtemp import create_database, drop_database

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tracetap.migrations import upgrade  # noqa: E402
from tracetap.storage.intents import Intents, intents_engine  # noqa: E402


async def short(intents: Intents, calls: int) -> tuple[float, float]:
    waited, cpu = 0.0, time.process_time()
    for i in range(calls):
        intents.admit(f"s-{i}", "ep")
        started = time.perf_counter()
        await intents.wait(f"s-{i}")
        waited += time.perf_counter() - started
    return waited / calls, (time.process_time() - cpu) / calls


async def in_flight(intents: Intents, calls: int, at_once: int) -> tuple[float, float]:
    waited, cpu = 0.0, time.process_time()
    for start in range(0, calls, at_once):
        ids = [f"f-{i}" for i in range(start, min(calls, start + at_once))]
        for call_id in ids:
            intents.admit(call_id, "ep")
        await asyncio.sleep(0.1)  # the calls run (their intents are stored meanwhile)
        started = time.perf_counter()
        for call_id in ids:
            await intents.wait(call_id)
        waited += time.perf_counter() - started
    return waited / calls, (time.process_time() - cpu) / calls


async def main(args: argparse.Namespace, url: str) -> None:
    engine = intents_engine(url)
    intents = Intents(engine, "bench")
    intents.ready = True
    intents.start()
    try:
        await short(intents, 50)  # warm-up: connections, statement cache
        wait, cpu = await short(intents, args.calls)
        print(f"short calls, one at a time: answer waited {wait * 1e3:.3f} ms, "
              f"process CPU {cpu * 1e3:.3f} ms per call")
        idle = time.process_time()
        await asyncio.sleep(0.1 * (args.calls // args.at_once))
        idle = (time.process_time() - idle) / args.calls
        wait, cpu = await in_flight(intents, args.calls, args.at_once)
        print(f"calls in flight, {args.at_once} at a time: answer waited {wait * 1e3:.3f} ms, "
              f"process CPU {(cpu - idle) * 1e3:.3f} ms per call (idle subtracted)")
    finally:
        await intents.close(clean=True)
        await engine.dispose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--at-once", type=int, default=32)
    args = parser.parse_args()
    url = create_database()
    try:
        upgrade(url)
        asyncio.run(main(args, url))
    finally:
        drop_database(url)
