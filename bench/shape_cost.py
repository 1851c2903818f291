"""The writer's per-call CPU for a request's search text and its cut into blocks, by API
(storage.search_text.call_text, storage.blocks.cut_text), with a digest of what each gives
(to compare two checkouts' outputs byte for byte).

    python bench/shape_cost.py

Prints ``{endpoint: [request bytes, call_text µs, cut_text µs, text digest, blocks
digest]}`` (CPU time, best of 7). A checkout from before the APIs declared their request
shapes (no ``shape`` argument) is measured as it was called then, so the two can be
compared by running this script with each checkout's packages first on the path
(bench/results/request-shapes.md).
"""

from __future__ import annotations

import hashlib
import json
import time
import timeit

from tracetap.storage import blocks, search_text
from tracetap.storage.records import CallRecord

SHAPED = "shape" in search_text.text_of.__code__.co_varnames
LISTS = {"chat.completions": "messages", "responses": "input", "messages": "messages"}


def chat(turns: int) -> str:
    """An agent's chat request: a system prompt, then a tool call and its output a turn."""
    messages = [{"role": "system", "content": "Be an agent. " * 50}]
    for i in range(turns):
        messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function",
             "function": {"name": "ls", "arguments": '{"path": "/tmp"}'}}]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": f"file{i}.txt " * 80}]
    return json.dumps({"model": "m", "messages": messages})


def responses(turns: int) -> str:
    """The same in Responses items: function calls and their outputs after the task."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "task " * 30}]}]
    for i in range(turns):
        items += [{"type": "function_call", "call_id": f"c{i}", "name": "ls", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": f"c{i}", "output": f"out{i} " * 80}]
    return json.dumps({"model": "m", "instructions": "be good", "input": items})


def messages() -> str:
    return json.dumps({"system": "x", "messages": [
        {"role": "user", "content": "hi " * 50}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "more " * 400}]})


def main() -> None:
    if SHAPED:
        from tracetap.proxy.apis.registry import readers
        table = readers()
    out = {}
    for endpoint, request in (("chat.completions", chat(100)), ("responses", responses(100)),
                              ("messages", messages())):
        record = CallRecord(call_id="a", episode_id="e", endpoint=endpoint, t_start=0.0,
                            status="ok", http_status=200, instance="i", request=request)
        if SHAPED:
            def text(record=record):
                return search_text.call_text(record, table)

            def cut(request=request, key=LISTS[endpoint]):
                return blocks.cut_text(request, key)[0]
        else:
            def text(record=record):
                return search_text.call_text(record)

            def cut(request=request):
                return blocks.cut_text(request)[0]
        text_us = min(timeit.repeat(text, number=200, repeat=7, timer=time.process_time)) / 200
        cut_us = min(timeit.repeat(cut, number=50, repeat=7, timer=time.process_time)) / 50
        out[endpoint] = [len(request), round(text_us * 1e6, 1), round(cut_us * 1e6, 1),
                         hashlib.sha256(text().encode()).hexdigest()[:12],
                         hashlib.sha256(b"".join(h for (h, _), _ in cut())).hexdigest()[:12]]
    print("shaped" if SHAPED else "before shapes", json.dumps(out))


if __name__ == "__main__":
    main()
