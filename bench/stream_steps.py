"""CPU of each step of relaying one stream (and one body), minimum over many rounds.

    python bench/stream_steps.py              # ~30 s, no database

capture_cost.py gives the steps of a whole call once; on a shared machine its figures
move by a third from run to run. This times the per-event steps of the bench upstream's
64-token stream (the client asks for nothing: logprobs, token ids and usage injected and
stripped) and keeps each step's minimum over ``--rounds`` rounds, which approximates a
core of its own: SSE parsing of the 65 reads, capture, strip, both as one step
(proxy.apis.chat.stream_step: the byte-range cut), and the whole relay path as
``ModelCall.run`` hands it to the call's ``Relay``: ``Relay.chunk`` per read (parsing,
capture, strip and the client's bytes), one event a read (a paced engine) and all 65 in
one read (an engine ahead of the proxy). Run it with another tree's interpreter for that
tree's figures (a step the tree lacks prints "-").
"""

from __future__ import annotations

import argparse
import sys
import time
from types import SimpleNamespace

from capture_cost import CHAT, ModelCall, _request, _state
from upstream import BODIES, STREAMS

from tracetap.proxy.apis import Injected
from tracetap.proxy.apis.chat import CHAT as CHAT_ENDPOINT
from tracetap.proxy.apis.chat.capture import Capture
from tracetap.proxy.apis.chat.inject import strip_body, strip_chunk
from tracetap.proxy.http.sse import SSEParser

try:
    from tracetap.proxy.apis.chat.stream_step import ChatStreamStep
except ImportError:  # a tree from before the one-step path
    ChatStreamStep = None

READS = STREAMS[True, True, True][:-1]  # [DONE] left out: its read journals the call
EVENTS = SSEParser().feed(b"".join(READS))
DATAS = [event.data for event in EVENTS]
BODY = BODIES[True, True]
INJECTED = Injected(logprobs=True, usage=True, token_ids=True)


def _parse() -> None:
    parser = SSEParser()
    for data in READS:
        parser.feed(data)


def _capture() -> None:
    capture = Capture(CHAT_ENDPOINT)
    for data in DATAS:
        capture.add(data)


def _step() -> None:
    step = ChatStreamStep(Capture(CHAT_ENDPOINT), INJECTED)
    for event in EVENTS:
        step(event.data, event)


def _relay(state, request: bytes, reads: list[bytes] = READS) -> None:
    call = ModelCall(state, CHAT, "x")
    call.parse_request(request)
    call.versions.admit()  # as every call the gate lets through: its tokens' versions followed
    call.replied("http://bench", 200)
    relay = call.start_relay()
    for data in reads:
        for _ in relay.chunk(data):
            pass


ONE_READ = [b"".join(READS)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--repeat", type=int, default=50, help="runs of a step per round")
    args = parser.parse_args()
    state, request = _state(), _request(True)
    state.controls = SimpleNamespace(policy_version="v1", serial=0)  # policy.versions reads
    state.gate = SimpleNamespace(paused=False)
    steps = {
        "SSE parse (65 reads)": _parse,
        "capture (65 events)": _capture,
        "strip (65 events)": lambda: [strip_chunk(d, INJECTED) for d in DATAS],
        "capture + strip, one step (65 events)": _step if ChatStreamStep is not None else None,
        "relay path: ModelCall, Relay.chunk per read": lambda: _relay(state, request),
        "relay path, the 65 events in one read": lambda: _relay(state, request, ONE_READ),
        "body: capture": lambda: Capture(CHAT_ENDPOINT).add(BODY),
        "body: strip": lambda: strip_body(BODY, INJECTED),
    }
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(args.rounds):
        for name, step in steps.items():
            if step is None:
                continue
            started = time.process_time()
            for _ in range(args.repeat):
                step()
            best[name] = min(best[name], (time.process_time() - started) / args.repeat * 1e6)
    print(f"{'CPU microseconds, minimum over rounds':40s} {'per stream':>10s} {'per event':>10s}")
    for name, us in best.items():
        if us == float("inf"):
            print(f"{name:40s} {'-':>10s} {'-':>10s}")
            continue
        per_event = f"{us / len(DATAS):10.2f}" if "body" not in name else f"{'':10s}"
        print(f"{name:40s} {us:10.1f} {per_event}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
