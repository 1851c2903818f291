"""CPU of each step of one agentic turn by context, in process, minimum over rounds.

    python bench/agentic_steps.py                  # turns 0, 4, 12, 24 and 29, ~20 s
    python bench/agentic_steps.py --turns 24 --profile   # and where the events' CPU goes

bench/agentic.py measures whole turns through real processes on a shared machine, where
a turn's CPU moves by a third from run to run. This times the steps of
``ModelCall`` for one turn of bench/agentic_shape.py's sessions (the client asks for
nothing: logprobs, token ids and usage are injected and stripped), each step's minimum
over ``--rounds``: the request (decode, inject, encode), the first chunk (it carries the
prompt's ids), the other events, and the record (the prompt ids decoded, here in the
new tokens only, as the previous turn of the episode went first). The garbage collector
runs as ``tracetap serve`` sets it (start-up objects frozen, a high first threshold):
with the default thresholds its collections land on the events and inflate them by half.
``--profile``: cProfile's view of the other events of the last turn asked for.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import itertools
import pstats
import sys
import time

from agentic_engine import Engine
from agentic_load import Conversation
from agentic_shape import Sizes
from capture_cost import CHAT, ModelCall, _state

STEPS = ("request", "first chunk", "other events", "record")


def reads(engine: Engine, turn: int) -> list[bytes]:
    events = engine.events(0, turn, True, True)
    return [engine.first_event(0, turn, events[0], True), *events[1:],
            engine.usage_event(0, turn), b"data: [DONE]\n\n"]


def one_turn(state, body: bytes, stream: list[bytes], clock) -> list[float]:
    times = [clock()]
    call = ModelCall(state, CHAT, "x")
    call.episode_id = "steps"
    call.parse_request(body)
    call.replied("http://bench", 200)
    relay = call.start_relay()
    times.append(clock())
    list(relay.chunk(stream[0]))
    times.append(clock())
    for data in stream[1:-1]:
        list(relay.chunk(data))
    times.append(clock())
    list(relay.chunk(stream[-1]))  # [DONE]: the record is built (ids decoded), not stored
    relay.end()
    times.append(clock())
    return [b - a for a, b in itertools.pairwise(times)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[0, 4, 12, 24, 29])
    parser.add_argument("--tool", type=int, default=2000)
    parser.add_argument("--out", type=int, default=400)
    parser.add_argument("--system", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--profile", action="store_true",
                        help="print cProfile's top functions of the last turn's other events")
    args = parser.parse_args()
    gc.freeze()  # as proxy/server/serve.py does
    gc.set_threshold(50_000)
    sizes = Sizes(1, max(args.turns) + 1, args.tool, args.out, args.system)
    engine = Engine(sizes, 1)
    conv = Conversation(engine.sessions[0], "plain")
    bodies = [conv.body(t) for t in range(sizes.turns)]
    print(f"{'CPU ms, minimum over rounds':<28}" + "".join(f"{s:>14}" for s in STEPS)
          + f"{'whole turn':>12}")
    for turn in args.turns:
        stream = reads(engine, turn)
        best = [float("inf")] * len(STEPS)
        for _ in range(args.rounds):
            state = _state()
            if turn:  # the episode's previous turn: its ids are the next one's prefix
                one_turn(state, bodies[turn - 1], reads(engine, turn - 1), time.process_time)
            spent = one_turn(state, bodies[turn], stream, time.process_time)
            best = [min(b, s) for b, s in zip(best, spent)]
        label = f"context {sizes.context(turn):,}"
        print(f"{label:<28}" + "".join(f"{b * 1e3:>14.2f}" for b in best)
              + f"{sum(best) * 1e3:>12.2f}")
    if args.profile:
        profile(bodies, engine, args.turns[-1])
    return 0


def profile(bodies: list[bytes], engine: Engine, turn: int) -> None:
    """cProfile of the events after the first, 5 rounds of ``turn``, top 20 by own time."""
    profiler = cProfile.Profile()
    stream = reads(engine, turn)
    for _ in range(5):
        state = _state()
        if turn:
            one_turn(state, bodies[turn - 1], reads(engine, turn - 1), time.process_time)
        call = ModelCall(state, CHAT, "x")
        call.episode_id = "steps"
        call.parse_request(bodies[turn])
        call.replied("http://bench", 200)
        relay = call.start_relay()
        list(relay.chunk(stream[0]))
        profiler.enable()
        for data in stream[1:-1]:
            list(relay.chunk(data))
        profiler.disable()
        list(relay.chunk(stream[-1]))
        relay.end()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    sys.exit(main())
