"""CPU cost of translating one chat stream chunk into Responses / Messages events.

    python bench/translate_cost.py            # ~10 s

Each figure is microseconds per one-token content chunk, best of 5 runs of 20,000:
decoding the chunk bytes (msgspec), reading it, translating it and encoding the SSE
event. "read only" is the decode and read alone, the floor both translators share.
"""

from __future__ import annotations

import time

import msgspec

from tracetap.proxy.apis.chat.reply import read_chunk
from tracetap.proxy.apis.messages import translate as messages
from tracetap.proxy.apis.responses import translate as responses

N, RUNS = 20_000, 5
CHUNK = msgspec.json.encode({
    "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
    "choices": [{"index": 0, "delta": {"content": "tok"}, "logprobs": None,
                 "finish_reason": None}]})


class _ReadOnly:
    def feed(self, chunk: dict) -> list[bytes]:
        read_chunk(chunk)
        return []


def per_chunk_us(make) -> float:
    best = float("inf")
    for _ in range(RUNS):
        translator, decode = make(), msgspec.json.decode
        start = time.perf_counter()
        for _ in range(N):
            translator.feed(decode(CHUNK))
        best = min(best, (time.perf_counter() - start) / N * 1e6)
    return best


def main() -> None:
    for label, make in (
        ("read only", _ReadOnly),
        ("responses", lambda: responses.StreamTranslator({"model": "m", "input": "x"})),
        ("messages", lambda: messages.StreamTranslator({"model": "m", "messages": []})),
    ):
        print(f"{label:>10}: {per_chunk_us(make):6.2f} us per chunk")


if __name__ == "__main__":
    main()
