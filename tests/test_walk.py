"""The walk of one request through the rooms (docs/architecture.md): a chat stream, a
Responses stream, native and translated, and an Anthropic Messages stream (translated to
chat), traced through the in-process proxy. A room is a module; each entry into a room
from another is counted (a coroutine or generator resumed is not an entry; a return to
the caller is not one either). The driver (``ModelCall.run``) must be entered once by
the handler and come back to only once, as the relay sees the end (``end_reached``): no
per-read or per-event work may call back into it, and the handler is entered once."""

from __future__ import annotations

import asyncio
import collections
import sys
from pathlib import Path

import pytest
from helpers.http import post
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.migrations import upgrade
from tracetap.proxy.runtime.settings import Settings

ROOT = str(Path(__file__).resolve().parents[1]) + "/"
_GENERATOR_FLAGS = 0x20 | 0x80 | 0x100 | 0x200  # generator, coroutine, async generator
# Rooms of the walk that do a step's work: each at most twice (docs/architecture.md).
# The request is made empty as the call starts and filled by the parse (the record reads
# its bytes); the upstream's reply is sent, then read to its end, which closes it.
WALK_ROOMS = {"call/handlers": 1, "http/exposure": 2, "apis/routing": 2, "call/driver": 2,
              "episodes/tagging": 1, "http/bodies": 1, "call/request": 2,
              "overlays/runner": 1, "call/continuation": 2, "upstream/pool": 2,
              "upstream/client": 2, "call/relay": 2, "call/record": 1, "storage/writer": 1}


def room_of(filename: str) -> str | None:
    """The room of a tracetap source file: its module under proxy/ (wing/module; an API's
    package counted as one room), or storage/<module>; None for anything else."""
    if not filename.startswith(ROOT):
        return None
    parts = filename[len(ROOT):].removesuffix(".py").split("/")
    if parts[0] == "proxy":
        if len(parts) >= 4 and parts[1] == "apis":
            return "apis/" + parts[2]
        return "/".join(parts[1:])
    return "/".join(parts) if parts[0] == "storage" else None


class Walk:
    """A profile hook for the loop's thread: the entries into rooms made by the task
    that serves the first agent request it sees."""

    def __init__(self) -> None:
        self.task = None
        self.started: set = set()  # generator and coroutine frames already entered
        self.entries: list[tuple[str, str, str]] = []  # (room, function, from room)

    def __call__(self, frame, event, arg) -> None:
        if event != "call":
            return
        room = room_of(frame.f_code.co_filename)
        if room is None or frame in self.started:
            return  # not a room, or a coroutine resumed (not an entry)
        if frame.f_code.co_flags & _GENERATOR_FLAGS:
            self.started.add(frame)
        if self.task is None:
            if frame.f_code.co_name != "agent_request":
                return
            self.task = asyncio.current_task()
        elif asyncio.current_task() is not self.task:
            return  # another request, the writer, the engine
        caller, back = None, frame.f_back
        while back is not None and caller is None:
            caller = room_of(back.f_code.co_filename)
            back = back.f_back
        if caller != room:
            self.entries.append((room, frame.f_code.co_qualname, caller or "-"))

    def visits(self) -> collections.Counter:
        return collections.Counter(room for room, _, _ in self.entries)


@pytest.fixture
def proxy(loop_thread, engine, tmp_path):
    url = f"sqlite:///{tmp_path / 'tracetap.db'}"
    upgrade(url)
    settings = Settings(upstream=engine.url, db=url, data_dir=str(tmp_path / "data"),
                        port=free_port(), upstream_flavor="vllm")
    p = Proxy(loop_thread, settings).start()
    yield p
    p.stop()


def _walk(proxy, path: str, body: dict) -> Walk:
    # imports and connections made
    assert post(proxy.url + "/episodes/warm/v1" + path, body)[0] == 200
    walk = Walk()
    loop = proxy.loop
    loop.run(_call(sys.setprofile, walk))
    try:
        assert post(proxy.url + "/episodes/walk/v1" + path, body)[0] == 200
    finally:
        loop.run(_call(sys.setprofile, None))
    return walk


async def _call(f, *args):
    f(*args)


_TOOLS = [{"type": "function", "name": "lookup",
           "parameters": {"type": "object", "properties": {}}}]
CASES = {
    "chat, streamed and rewritten": ("/chat/completions", "chat.completions", {
        "messages": [{"role": "user", "content": "hello"}]}),
    "responses, native": ("/responses", "responses", {"input": "hello"}),
    "responses, translated (tools)": ("/responses", "responses:chat", {
        "input": "hello", "tools": _TOOLS}),
    "messages, translated": ("/messages", "messages:chat", {
        "messages": [{"role": "user", "content": "hello"}]}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_driver_is_entered_once_and_visited_again_only_at_the_end(proxy, case):
    """Kills a handler that drives the call step by step, a relay that calls back into
    the call per read or per event (``ModelCall.arrived`` as it was), and a walk that
    comes back to any of its rooms a third time."""
    path, endpoint, body = CASES[case]
    walk = _walk(proxy, path, {"model": "mock-model", "stream": True, "max_tokens": 8,
                               **body})
    [call] = proxy.calls("walk")
    assert (call["endpoint"], call["status"]) == (endpoint, "ok")
    into_driver = [(name, caller) for room, name, caller in walk.entries
                   if room == "call/driver"]
    assert into_driver == [("ModelCall.run", "call/handlers"),
                           ("ModelCall.end_reached", "call/relay")]
    assert {name for room, name, _ in walk.entries if room == "call/relay"} == {
        "Relay.__init__", "Relay.pump"}
    visits = walk.visits()
    assert {room: visits[room] for room in WALK_ROOMS} == WALK_ROOMS


def test_a_messages_stream_is_translated_at_the_parse_by_the_relay_and_in_the_record(proxy):
    """Messages has no native path: its package is entered to translate the request in
    the parse, for its completion cap (the budget's reservation), by the relay to make
    the client's stream (its translator made once, fed per chat chunk, finished at the
    end), by the record for the client's reply, and by the lineage for the start of its
    conversation, and from nowhere else. Kills a translator made per read or per event, a
    translation the driver or the handler does itself, and a record that skips the
    client's shape."""
    walk = _walk(proxy, "/messages", {"model": "mock-model", "stream": True,
                                      "max_tokens": 8, **CASES["messages, translated"][2]})
    [call] = proxy.calls("walk")
    assert (call["endpoint"], call["status"]) == ("messages:chat", "ok")
    into_messages = [(name, caller) for room, name, caller in walk.entries
                     if room == "apis/messages"]
    feeds = into_messages.count(("StreamTranslator.feed", "call/relay"))
    assert feeds >= 2, into_messages
    assert into_messages == [
        ("to_chat", "call/request"),
        ("messages_caps", "apis/registry"),  # its completion cap, for the budget
        ("StreamTranslator.__init__", "call/relay"),
        *[("StreamTranslator.feed", "call/relay")] * feeds,
        ("StreamTranslator.finish", "call/relay"),
        ("from_chat", "call/record"),
        ("read_messages", "episodes/lineage")]  # the start of its conversation, hashed
