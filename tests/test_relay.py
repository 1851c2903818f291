"""What the client receives, byte for byte, and when the call is journaled.

The upstream here writes JSON the way Python's ``json`` does (spaces after ``:`` and
``,``, non-ASCII as is), not the way the proxy's encoder would: a reply the proxy decoded
and re-encoded could not pass for the upstream's own. It behaves like vLLM otherwise:
logprobs, token ids and the usage chunk only when asked for.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import msgspec
import openai
import pytest
from aiohttp import web
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.proxy.apis.chat.capture import Capture
from tracetap.proxy.call.relay import Relay
from tracetap.proxy.runtime.settings import Settings

MESSAGES = [{"role": "user", "content": "Say hi."}]
WORDS = ["Hé", " there", ",  friend"]  # a double space: re-encoding would not keep it
IDS = [1001, 1002, 1003]
# Enough for the first chunk's ids to be cut out by bytes (proxy.prompt_cut), spaced.
PROMPT_IDS = [7, 8, 9, 10] * 600
LOGPROBS = [-0.25, -1.5, -0.125]
HEAD = {"id": "chatcmpl-spaced", "created": 1700000000, "model": "spaced-model"}
USAGE = {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3}


def _dumps(value) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode()


def _alternatives(word: str, logprob: float, top: int) -> list[dict]:
    return [{"token": t, "logprob": lp, "bytes": list(t.encode())}
            for t, lp in [(word, logprob), ("alt", logprob - 1.0)][:top]]


def _logprobs(words, logprobs, top: int = 0) -> dict:
    return {"content": [{"token": w, "logprob": lp, "bytes": list(w.encode()),
                         "top_logprobs": _alternatives(w, lp, top)}
                        for w, lp in zip(words, logprobs)]}


def whole_reply(asked: dict) -> bytes:
    token_ids = asked.get("return_token_ids") is True
    choice = {"index": 0, "message": {"role": "assistant", "content": "".join(WORDS)},
              "logprobs": _logprobs(WORDS, LOGPROBS, asked.get("top_logprobs") or 0)
              if asked.get("logprobs") else None,
              "finish_reason": "stop", "stop_reason": None,
              "token_ids": IDS if token_ids else None}
    return _dumps({**HEAD, "object": "chat.completion", "choices": [choice], "usage": USAGE,
                   "prompt_logprobs": None, "prompt_token_ids": PROMPT_IDS if token_ids else None})


def stream_writes(asked: dict) -> list[bytes]:
    """The stream as the upstream writes it, one write per element."""
    token_ids = asked.get("return_token_ids") is True
    usage = (asked.get("stream_options") or {}).get("include_usage") is True
    writes = [b": warming up\n\n"]  # an SSE comment: relayed, never parsed as data
    for i, word in enumerate(WORDS):
        choice = {"index": 0, "delta": {"role": "assistant", "content": word} if i == 0
                  else {"content": word},
                  "logprobs": _logprobs([word], [LOGPROBS[i]], asked.get("top_logprobs") or 0)
                  if asked.get("logprobs") else None,
                  "finish_reason": "stop" if i == len(WORDS) - 1 else None}
        if token_ids:
            choice["token_ids"] = [IDS[i]]
        chunk = {**HEAD, "object": "chat.completion.chunk", "choices": [choice]}
        if token_ids and i == 0:
            chunk["prompt_token_ids"] = PROMPT_IDS
        if usage:
            chunk["usage"] = None
        event = b"data: " + _dumps(chunk) + b"\n\n"
        if i == 0:  # the prompt's ids in three reads, the cuts inside the array
            middle = len(event) // 2
            writes += [event[:20], event[20:middle], event[middle:]]
        else:
            writes += [event[:20], event[20:]] if i == 1 else [event]  # in two reads
    if usage:
        chunk = {**HEAD, "object": "chat.completion.chunk", "choices": [], "usage": USAGE}
        writes.append(b"data: " + _dumps(chunk) + b"\n\n")
    writes.append(b"data: [DONE]\n\n")
    return writes


class SpacedUpstream:
    """The upstream app; ``hold`` keeps each stream open after ``[DONE]`` until released;
    ``joined_end`` writes the last content chunk, the usage chunk and ``[DONE]`` at once."""

    def __init__(self, loop_thread, hold: bool = False, joined_end: bool = False):
        self.loop_thread = loop_thread
        self.hold = hold
        self.joined_end = joined_end
        self.received: list[dict] = []
        self.raw: list[bytes] = []  # the request bodies as they arrived
        self.released = asyncio.Event()  # created outside the loop: bound on first wait

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.raw.append(await request.read())
        asked = await request.json()
        self.received.append(asked)
        if not asked.get("stream"):
            return web.Response(body=whole_reply(asked), content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        writes = stream_writes(asked)
        if self.joined_end:  # one write, one TCP send: vLLM's last events often share one
            writes = [*writes[:-3], b"".join(writes[-3:])]
        for data in writes:
            await response.write(data)
            await asyncio.sleep(0)  # let each write go out on its own
        if self.hold:
            await self.released.wait()
        await response.write_eof()
        return response

    def release(self) -> None:
        self.loop_thread.loop.call_soon_threadsafe(self.released.set)


@pytest.fixture
def db_url(tmp_path, migrated_sqlite) -> str:
    """SQLite only: what is checked here does not depend on the database (the storage
    tests run on both)."""
    return migrated_sqlite(tmp_path / "tracetap.db")


@pytest.fixture
def spaced(loop_thread, serve_app):
    upstream = SpacedUpstream(loop_thread)
    upstream.url = serve_app(upstream.app()) + "/v1"
    return upstream


@pytest.fixture
def held(loop_thread, serve_app):
    upstream = SpacedUpstream(loop_thread, hold=True)
    upstream.url = serve_app(upstream.app()) + "/v1"
    return upstream


def _proxy(loop_thread, upstream: SpacedUpstream, db_url: str, tmp_path) -> Proxy:
    settings = Settings(upstream=upstream.url, db=db_url, data_dir=str(tmp_path / "d"),
                        port=free_port(), upstream_flavor="vllm")
    return Proxy(loop_thread, settings).start()


@pytest.fixture
def joined(loop_thread, serve_app):
    upstream = SpacedUpstream(loop_thread, joined_end=True)
    upstream.url = serve_app(upstream.app()) + "/v1"
    return upstream


@pytest.fixture
def proxy_to_spaced(loop_thread, spaced, db_url, tmp_path):
    proxy = _proxy(loop_thread, spaced, db_url, tmp_path)
    yield proxy
    proxy.stop()


@pytest.fixture
def proxy_to_held(loop_thread, held, db_url, tmp_path):
    proxy = _proxy(loop_thread, held, db_url, tmp_path)
    yield proxy
    held.release()  # a failed test must not leave the proxy waiting on the upstream
    proxy.stop()


# What the client asks for itself: everything capture needs, or nothing.
EVERYTHING = {"logprobs": True, "top_logprobs": 0,
              "extra_body": {"return_token_ids": True}}
EVERYTHING_STREAMED = {**EVERYTHING, "stream_options": {"include_usage": True}}


def _raw(base_url: str, stream: bool, asks: dict) -> bytes:
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    with client:
        if not stream:
            return client.chat.completions.with_raw_response.create(
                model="spaced-model", messages=MESSAGES, **asks).content
        with client.chat.completions.with_streaming_response.create(
                model="spaced-model", messages=MESSAGES, stream=True, **asks) as response:
            return b"".join(response.iter_bytes())


def _raw_values(data: bytes) -> list[bytes]:
    """Each top-level value but the choices, and each value inside a choice, as written."""
    top = msgspec.json.decode(data, type=dict[str, msgspec.Raw])
    values = [bytes(v) for k, v in top.items() if k != "choices"]
    choices = msgspec.json.decode(top.get("choices", b"[]"),
                                  type=list[dict[str, msgspec.Raw]])
    return values + [bytes(v) for choice in choices for v in choice.values()]


def _events(stream: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in stream.split(b"\n\n") if e]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_asks_for_everything_gets_the_upstreams_bytes(
        proxy_to_spaced, spaced, stream):
    asks = EVERYTHING_STREAMED if stream else EVERYTHING
    direct = _raw(spaced.url, stream, asks)
    proxied = _raw(proxy_to_spaced.episode_url("raw"), stream, asks)
    assert proxied == direct
    assert b",  friend" in direct and "Hé".encode() in direct
    # Nothing was added to the request: the proxy had nothing to take out again.
    assert spaced.received[0] == spaced.received[1]
    [call] = proxy_to_spaced.calls("raw")
    assert call["status"] == "ok" and call["prompt_ids"] == PROMPT_IDS
    assert call["choices"][0]["completion_ids"] == IDS
    assert call["choices"][0]["completion_logprobs"] == LOGPROBS
    assert call["choices"][0]["text"] == "".join(WORDS)


# What a client may ask for itself while the proxy adds the rest (and takes it out again).
PARTIAL = {
    "nothing": {},
    "logprobs": {"logprobs": True, "top_logprobs": 2},
    "token-ids": {"extra_body": {"return_token_ids": True}},
}
PARTIAL_STREAMED = {**PARTIAL, "usage": {"stream_options": {"include_usage": True}}}


def _stored_tops(asks: dict) -> list | None:
    """The alternatives capture keeps: only those the client asked for."""
    top = asks.get("top_logprobs") or 0
    if not top:
        return None
    return [[{"token": a["token"], "logprob": a["logprob"]} for a in _alternatives(w, lp, top)]
            for w, lp in zip(WORDS, LOGPROBS)]


@pytest.mark.parametrize("asks", PARTIAL.values(), ids=PARTIAL.keys())
def test_a_whole_reply_loses_only_what_the_proxy_asked_for(proxy_to_spaced, spaced, asks):
    direct = _raw(spaced.url, False, asks)
    proxied = _raw(proxy_to_spaced.episode_url("strip"), False, asks)
    assert spaced.received[-1]["logprobs"] is True  # the proxy did add something
    assert spaced.received[-1]["return_token_ids"] is True
    assert json.loads(proxied) == json.loads(direct)
    for value in _raw_values(direct):  # what was not removed keeps the upstream's bytes
        assert value in proxied, value
    [call] = proxy_to_spaced.calls("strip")
    choice = call["choices"][0]
    assert (choice["completion_ids"], choice["completion_logprobs"]) == (IDS, LOGPROBS)
    assert call["prompt_ids"] == PROMPT_IDS
    assert choice["top_logprobs"] == _stored_tops(asks)
    assert call["response"].encode() == proxied  # stored as the client received it


@pytest.mark.parametrize("asks", PARTIAL_STREAMED.values(), ids=PARTIAL_STREAMED.keys())
def test_a_stream_loses_only_what_the_proxy_asked_for(proxy_to_spaced, spaced, asks):
    direct = _events(_raw(spaced.url, True, asks))
    proxied = _events(_raw(proxy_to_spaced.episode_url("strip-stream"), True, asks))
    upstream_asked = spaced.received[-1]
    assert upstream_asked["stream_options"] == {"include_usage": True}
    assert upstream_asked["logprobs"] is True and upstream_asked["return_token_ids"] is True
    assert len(proxied) == len(direct)  # a usage chunk only if the client asked for one
    for mine, theirs in zip(proxied, direct):
        if not theirs.startswith(b"data: {"):
            assert mine == theirs  # the comment and [DONE]
            continue
        assert json.loads(mine[6:]) == json.loads(theirs[6:])
        for value in _raw_values(theirs[6:].strip()):
            assert value in mine, value
    [call] = proxy_to_spaced.calls("strip-stream")
    choice = call["choices"][0]
    assert (choice["completion_ids"], choice["completion_logprobs"]) == (IDS, LOGPROBS)
    assert choice["top_logprobs"] == _stored_tops(asks)
    assert (call["prompt_tokens"], call["completion_tokens"]) == (4, 3)
    assert call["prompt_ids"] == PROMPT_IDS


# The client's own spelling: spaces, an escaped character, a member after the messages.
SPELLED = (b'{"model": "spaced-model",  "messages": [{"role": "user", "content": '
           b'"Say hi.\\u00e9"}], "stream": true, "temperature": 0.5}\n')


def _post(base_url: str, body: bytes) -> bytes:
    request = urllib.request.Request(base_url + "/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read()


def test_capture_s_members_are_added_and_the_payload_encoded_again(proxy_to_spaced, spaced):
    """The upstream gets the payload tracetap read, with capture's members, encoded again
    (msgspec's spelling, not the client's); the client's request is stored as sent."""
    _post(proxy_to_spaced.episode_url("spelled"), SPELLED)
    sent = spaced.raw[-1]
    assert sent == msgspec.json.encode(json.loads(sent))
    added = json.loads(sent)
    assert {k: added.pop(k) for k in ("logprobs", "top_logprobs", "stream_options",
                                      "return_token_ids")} == {
        "logprobs": True, "top_logprobs": 0, "stream_options": {"include_usage": True},
        "return_token_ids": True}
    assert added == json.loads(SPELLED)
    [call] = proxy_to_spaced.calls("spelled")
    assert call["request"].encode() == SPELLED and call["upstream_request"] is None
    assert call["choices"][0]["completion_ids"] == IDS


def test_a_client_member_the_proxy_sets_again_is_encoded_whole(proxy_to_spaced, spaced):
    """The client's ``"logprobs": false`` is set to true: the key goes upstream once, with
    the value capture needs."""
    body = SPELLED.replace(b'"stream": true', b'"stream": true, "logprobs": false')
    _post(proxy_to_spaced.episode_url("respelled"), body)
    sent = spaced.raw[-1]
    assert sent == msgspec.json.encode(json.loads(sent)) and b'"logprobs":true' in sent
    assert sent.count(b'"logprobs"') == 1
    [call] = proxy_to_spaced.calls("respelled")
    assert call["request"].encode() == body and call["upstream_request"] is None


@pytest.mark.parametrize("asks", [{}, EVERYTHING_STREAMED], ids=["rewritten", "relayed"])
def test_a_stream_is_journaled_before_the_client_sees_done(proxy_to_held, held, asks):
    """The upstream keeps its connection open after [DONE]: the call must be on disk
    (then in the database) by the time the client has read [DONE], not when the
    upstream lets go."""
    client = openai.OpenAI(base_url=proxy_to_held.episode_url("done"), api_key="x",
                           max_retries=0)
    with client, client.chat.completions.with_streaming_response.create(
            model="spaced-model", messages=MESSAGES, stream=True, **asks) as response:
        seen = b""
        for data in response.iter_bytes():
            seen += data
            if b"data: [DONE]" in seen:
                break
        assert b"data: [DONE]" in seen
        [call] = proxy_to_held.calls("done")  # the upstream has not ended the stream yet
        held.release()
    assert call["status"] == "ok" and call["http_status"] == 200
    assert call["choices"][0]["completion_ids"] == IDS
    assert call["choices"][0]["finish_reason"] == "stop"
    assert proxy_to_held.calls("done") == [call]  # and never a second time


@pytest.mark.parametrize("asks", [{}, EVERYTHING_STREAMED], ids=["rewritten", "relayed"])
def test_the_record_is_submitted_before_the_write_that_carries_done(
        proxy_to_spaced, asks, monkeypatch):
    """The order itself, spied on in the proxy's process: the writer's ``submit`` comes
    before the write that gives the client ``data: [DONE]``. Kills the journal call moved
    to just after that write, on either relay path (``Relay._as_received`` after its
    last ``yield``, ``Relay._events`` leaving it to ``finish``): reading the record
    after the client has read [DONE] cannot tell, since the late journal has happened too
    by then."""
    order: list[str] = []
    writer = proxy_to_spaced.state.writer
    submit = writer.submit

    def spied_submit(record, *rest):  # rest: the request's bytes (Writer.submit)
        order.append(f"submit {record.episode_id}")
        return submit(record, *rest)

    write = web.StreamResponse.write

    async def spied_write(self, data):
        if b"data: [DONE]" in data:  # the upstream's own [DONE] write, then the proxy's
            order.append("[DONE] written")
        return await write(self, data)

    monkeypatch.setattr(writer, "submit", spied_submit)
    monkeypatch.setattr(web.StreamResponse, "write", spied_write)
    raw = _raw(proxy_to_spaced.episode_url("order"), True, asks)
    assert raw.endswith(b"data: [DONE]\n\n")
    assert order == ["[DONE] written", "submit order", "[DONE] written"]
    [call] = proxy_to_spaced.calls("order")
    assert call["status"] == "ok" and call["choices"][0]["completion_ids"] == IDS


def test_events_in_the_read_that_carries_done_reach_the_client_byte_for_byte(
        loop_thread, joined, db_url, tmp_path, monkeypatch):
    """The upstream writes the last content chunk, the usage chunk and [DONE] at once, and
    the client asked for everything itself (the stream is relayed as it came): the bytes
    before the cut at ``data: [DONE]`` must go out too. Kills dropping ``data[:cut]`` in
    ``Relay._as_received``; the read boundary is checked in the proxy, so the test
    cannot pass with the three events arriving apart."""
    reads: list[bytes] = []
    chunk = Relay.chunk

    def spied_chunk(self, data):
        reads.append(data)
        return chunk(self, data)

    monkeypatch.setattr(Relay, "chunk", spied_chunk)
    proxy = _proxy(loop_thread, joined, db_url, tmp_path)
    try:
        direct = _raw(joined.url, True, EVERYTHING_STREAMED)
        proxied = _raw(proxy.episode_url("joined"), True, EVERYTHING_STREAMED)
        [call] = proxy.calls("joined")
    finally:
        proxy.stop()
    last_three = b"".join(stream_writes(joined.received[-1])[-3:])
    assert any(last_three in read for read in reads), "the three events came apart"
    assert proxied == direct
    assert direct.endswith(last_three) and b'"usage": {"prompt_tokens": 4' in last_three
    assert call["status"] == "ok" and call["choices"][0]["completion_ids"] == IDS
    assert (call["prompt_tokens"], call["completion_tokens"]) == (4, 3)


def test_events_before_done_in_its_read_go_out_before_the_journal(
        loop_thread, joined, db_url, tmp_path, monkeypatch):
    """Relayed as it came, the read that carries [DONE] is given out in two writes: the
    events before ``data: [DONE]`` at once, off the journal's time, and [DONE] itself
    after the record is submitted. Kills the cut lost (the whole read held back behind
    the journal, then written at once: the same bytes, later)."""
    proxy = _proxy(loop_thread, joined, db_url, tmp_path)
    order: list[tuple[str, bytes]] = []
    writer = proxy.state.writer
    submit = writer.submit
    monkeypatch.setattr(writer, "submit",
                        lambda record, *rest: (order.append(("submit", b"")),
                                                   submit(record, *rest))[1])
    write = web.StreamResponse.write

    async def spied_write(self, data):
        order.append(("write", bytes(data)))
        return await write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", spied_write)
    try:
        proxied = _raw(proxy.episode_url("cut"), True, EVERYTHING_STREAMED)
    finally:
        proxy.stop()
    last_three = b"".join(stream_writes(joined.received[-1])[-3:])
    before, done = last_three.split(b"data: [DONE]")
    assert proxied.endswith(last_three) and before
    # The proxy's last writes, either side of the journal (the upstream's own writes,
    # in this process too, come earlier: the three events in one).
    assert order[-3:] == [("write", before), ("submit", b""),
                          ("write", b"data: [DONE]" + done)]
    assert ("write", last_three) in order[:-3]  # the upstream wrote them at once


class AheadUpstream(SpacedUpstream):
    """An engine that had written ahead while the first chunk (a long prompt's ids) was in
    transit, so one read brings the first token and later events with it: the whole
    stream in one write (``"all"``), or the first two words in one write between pauses
    (``"two"``). The stream opens as vLLM's does, with a chunk that carries the role and
    no token."""

    def __init__(self, loop_thread, together: str):
        super().__init__(loop_thread)
        self.together = together

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.raw.append(await request.read())
        asked = await request.json()
        self.received.append(asked)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        role = {**HEAD, "object": "chat.completion.chunk", "choices": [{
            "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}]}
        events = _events(b"".join(stream_writes(asked)))
        writes = [b"data: " + _dumps(role) + b"\n\n" + b"".join(events)]
        if self.together == "two":  # the comment and the role, the two words, the rest
            writes = [writes[0][:writes[0].index(events[1])], events[1] + events[2],
                      b"".join(events[3:])]
        for data in writes:
            await response.write(data)
            await asyncio.sleep(0.05)
        await response.write_eof()
        return response


@pytest.mark.parametrize("together", ["all", "two"])
def test_the_first_token_goes_out_before_the_rest_of_its_read_is_captured(
        loop_thread, serve_app, db_url, tmp_path, monkeypatch, together):
    """The order itself (the first token waits for nothing else): when the
    read that carries the stream's first token also carries later events, the client's
    write of the first token comes before the relay captures the next event, and the
    rest of that read goes out in one more write, as every read after it does. Kills the
    read handled whole before its first piece is written (the first token then waits
    for every event behind it), the role-only chunk taken for the first token, and a
    read after the first token written event by event."""
    upstream = AheadUpstream(loop_thread, together)
    upstream.url = serve_app(upstream.app()) + "/v1"
    order: list[str] = []
    reads: list[bytes] = []
    chunk, add = Relay.chunk, Capture.add

    def spied_chunk(self, data):
        reads.append(data)
        order.append("read")
        return chunk(self, data)

    def spied_add(self, data):
        order.append("captured")
        return add(self, data)

    write = web.StreamResponse.write

    async def spied_write(self, data):
        if self._req is not None and self._req.path.startswith("/episodes/"):
            order.append("first written" if WORDS[0].encode() in data else "written")
        return await write(self, data)

    monkeypatch.setattr(Relay, "chunk", spied_chunk)
    monkeypatch.setattr(Capture, "add", spied_add)
    monkeypatch.setattr(web.StreamResponse, "write", spied_write)
    proxy = _proxy(loop_thread, upstream, db_url, tmp_path)
    try:
        proxied = _raw(proxy.episode_url("ahead"), True, {})
        [call] = proxy.calls("ahead")
    finally:
        proxy.stop()
    monkeypatch.undo()
    direct = _events(_raw(upstream.url, True, {}))
    proxied = _events(proxied)
    assert len(proxied) == len(direct)  # what the client gets is unchanged, only when
    for mine, theirs in zip(proxied, direct):
        assert mine == theirs if not theirs.startswith(b"data: {") else (
            json.loads(mine[6:]) == json.loads(theirs[6:]))
    assert any(WORDS[0].encode() in read and WORDS[1].encode() in read for read in reads), \
        "no read carried the first token and a later event"
    first = order.index("first written")
    assert order[:first].count("captured") == 2  # the role chunk and the first word only
    # then the other words and the usage chunk the proxy asked for
    assert order[first + 1:].count("captured") == len(WORDS)
    # each read from here on is one write at most (the rest of the first token's read
    # is one; a read that completes no event has none)
    writes = [segment.split().count("written")
              for segment in " ".join(order[first + 1:]).split("read")]
    assert writes[0] == 1 and max(writes) == 1, order
    assert call["status"] == "ok" and call["choices"][0]["completion_ids"] == IDS
