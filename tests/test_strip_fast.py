"""The byte-range cut (proxy.apis.chat.strip_fast, stream_step) gives exactly
``strip_chunk``'s bytes, or its exception, and exactly ``Capture.add``'s capture, on every
chunk: the engines' shapes, adversarial text in the content and the logprob tokens, other
shapes it must leave to the exact path, and mutated bytes."""

from __future__ import annotations

import json
import os
import random

import msgspec
import pytest

from tracetap.proxy.apis import Injected
from tracetap.proxy.apis.chat import CHAT, stream_step
from tracetap.proxy.apis.chat.capture import Capture
from tracetap.proxy.apis.chat.inject import strip_chunk
from tracetap.proxy.apis.chat.stream_step import ChatStreamStep
from tracetap.proxy.apis.chat.strip_fast import ChunkCutter, learn
from tracetap.proxy.http.sse import Event, encode_event

HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000,
        "model": "m"}
NASTY = ['"logprobs":{"content":[]}', ',"logprobs":', '"}]}', '},"finish_reason":null}]}',
         '\\', '\\"', '\\\\"', '"', '\u00e9\u2028', '\U0001f600', ']}', '{"index":0,"delta":',
         ',"token_ids":[1]', ',"usage":null}', '\n\t', '\u0000', '/']
SEEDS = int(os.environ.get("STRIP_FUZZ_SEEDS", "12"))
INJECTIONS = [Injected(logprobs=True, usage=True, token_ids=True),
              Injected(logprobs=True, usage=True, sglext=True),
              Injected(usage=True, token_ids=True),
              Injected(logprobs=True),
              Injected(logprobs=True, token_ids=True, experts=True)]


def _text(rng: random.Random) -> str:
    return "".join(rng.choice([*NASTY, "a", " ", "x"]) for _ in range(rng.randint(0, 5)))


def _entry(rng: random.Random, text: str) -> dict:
    entry = {"token": text, "logprob": -rng.random() * 3, "bytes": list(text.encode()[:4]),
             "top_logprobs": []}
    if rng.random() < 0.2:
        entry["top_logprobs"] = [{"token": _text(rng), "logprob": -1.5, "bytes": None}]
    return entry


def _delta(rng: random.Random, text: str) -> dict:
    kind = rng.random()
    if kind < 0.15:
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
    if kind < 0.25:
        return {"reasoning_content": text}
    if kind < 0.3:
        return {}
    return {"content": text}


def _choice(rng: random.Random, index: int = 0) -> dict:
    text = _text(rng)
    choice: dict = {"index": index, "delta": _delta(rng, text)}
    choice["logprobs"] = None if rng.random() < 0.1 else {"content": [_entry(rng, text)]}
    choice["finish_reason"] = rng.choice([None, None, None, "stop", "length", "tool_calls"])
    extra = rng.random()
    if extra < 0.15:
        choice["stop_reason"] = rng.choice([None, ".", 7, _text(rng)])
    elif extra < 0.3:
        choice["matched_stop"] = rng.choice([None, 2])
    if rng.random() < 0.8:
        choice["token_ids"] = [rng.randint(0, 200000) for _ in range(rng.randint(0, 3))]
    return choice


def _chunk(rng: random.Random) -> dict:
    """One chunk: mostly the token chunk engines stream, sometimes another shape."""
    body = dict(HEAD)
    shape = rng.random()
    if shape < 0.05:
        body["choices"] = []
        body["usage"] = {"prompt_tokens": 3, "completion_tokens": 2}
        return body
    body["choices"] = [_choice(rng)]
    if shape < 0.1:
        body["choices"].append(_choice(rng, 1))
    elif shape < 0.15:
        body["prompt_token_ids"] = [1, 2, 3]
    elif shape < 0.2:
        body["sglext"] = {"output_ids": [[4]]}
    elif shape < 0.25:
        body["usage"] = {"prompt_tokens": 3}
    if rng.random() < 0.3:
        body["usage"] = None
    return body


def _mutate(rng: random.Random, data: bytes) -> bytes:
    at = rng.randrange(len(data))
    how = rng.random()
    if how < 0.3:
        return data[:at] + data[at + 1:]
    if how < 0.6:
        return data[:at] + bytes([rng.choice(b' ,:{}[]"\\0a-e')]) + data[at:]
    if how < 0.8:
        return data[:at] + b" " + data[at:]
    return data.replace(b'"index":0', b'"index":0,"x":1', 1)


def _exact(data: bytes, injected: Injected) -> bytes | type[Exception] | None:
    try:
        return strip_chunk(data, injected)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return type(exc)


def _step(step: ChatStreamStep, data: bytes) -> bytes | type[Exception]:
    try:
        return step(data, Event(encode_event(data), data))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return type(exc)


def _state(capture: Capture) -> tuple:
    return (capture.model, capture.response_id, capture.created, capture.usage,
            capture.errors, capture.token_counts(), capture.choices(),
            capture.reassembled(with_logprobs=True), capture.prompt_ids)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_the_step_is_capture_add_and_strip_chunk_on_random_adversarial_streams(seed):
    rng = random.Random(seed)
    cut = 0
    for injected in INJECTIONS:
        keep_top = rng.random() < 0.5  # the client asked for top logprobs itself
        fused, reference = (Capture(CHAT, keep_top_logprobs=keep_top),
                            Capture(CHAT, keep_top_logprobs=keep_top))
        step = ChatStreamStep(fused, injected)
        for n in range(250):
            data = json.dumps(_chunk(rng), separators=(",", ":"),
                              ensure_ascii=rng.random() < 0.5).encode()
            if n > 20 and rng.random() < 0.3:
                data = _mutate(rng, data)
            probe = ChunkCutter(injected)  # the step's head, its parts given nowhere
            probe.head, probe._raw, probe._at = (step._cutter.head, step._cutter._raw,
                                                 step._cutter._at)
            cut += probe.cut(data) is not None
            expected = _exact(data, injected)
            reference.add(data)
            if isinstance(expected, bytes):
                expected = encode_event(expected)
            assert _step(step, data) == (b"" if expected is None else expected), data
            if n % 50 == 0:
                assert _state(fused) == _state(reference)
        assert _state(fused) == _state(reference)
    assert cut > 300  # the byte ranges did the work, not the exact path behind them


def test_the_usual_chunk_is_cut_without_the_exact_path(monkeypatch):
    injected = Injected(logprobs=True, usage=True, token_ids=True)
    capture = Capture(CHAT)
    step = ChatStreamStep(capture, injected)
    first = (b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":'
             b'[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
             b'"finish_reason":null}],"prompt_token_ids":[1,2]}')
    assert step(first, Event(b"", first)) == encode_event(strip_chunk(first, injected))
    token = (b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":'
             b'[{"index":0,"delta":{"content":"\\\",\\\"logprobs\\\":{}}]}"},"logprobs":'
             b'{"content":[{"token":"\\\\","logprob":-0.5,"bytes":[92],"top_logprobs":[]}]},'
             b'"finish_reason":null,"token_ids":[7]}]}')
    expected = strip_chunk(token, injected)
    monkeypatch.setattr(stream_step, "strip_chunk", None)  # the exact path is not taken
    monkeypatch.setattr(capture, "add", None)
    assert step(token, Event(b"", token)) == encode_event(expected)
    assert expected.endswith(b'"logprobs":null,"finish_reason":null}]}')
    assert capture.token_counts() == {0: 1}
    [choice] = capture.choices()
    assert choice.text == '","logprobs":{}}]}' and choice.completion_ids == [7]
    assert choice.completion_logprobs == [-0.5]


@pytest.mark.parametrize("data", [
    # whitespace between members: strip_chunk writes the level compactly
    b'{"id":"c","choices":[{"index":0,"delta":{} ,"logprobs":{},"finish_reason":null}]}',
    b'{"id":"c","choices":[{"index":0,"delta":{},"logprobs":{},"finish_reason":null,'
    b'"token_ids":[1] }]}',
    # a member between the logprobs and the finish reason
    b'{"id":"c","choices":[{"index":0,"delta":{},"logprobs":{},"x":1,'
    b'"finish_reason":null}]}',
    # the logprobs key twice: the last one wins
    b'{"id":"c","choices":[{"index":0,"delta":{},"logprobs":{},"logprobs":{},'
    b'"finish_reason":null}]}',
    # a logprobs key inside the delta, none in the choice
    b'{"id":"c","choices":[{"index":0,"delta":{"a":{},"logprobs":{}},"x":{},'
    b'"finish_reason":null}]}',
    # two choices, the second with the finish reason
    b'{"id":"c","choices":[{"index":0,"delta":{},"logprobs":{}},{"index":1,"delta":{},'
    b'"logprobs":{},"finish_reason":null}]}',
])
def test_shapes_outside_the_cut_take_the_exact_path(data):
    cutter = ChunkCutter(Injected(logprobs=True, usage=True, token_ids=True))
    cutter.learn(b'{"id":"c","choices":[{"index":0,"delta":{},"logprobs":null}]}')
    assert cutter.head is not None and data.startswith(cutter.head.raw)
    assert cutter.cut(data) is None


def test_a_head_is_learned_only_where_strip_chunk_writes_it_as_it_came():
    tail = b'"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":null}]}'
    assert learn(b'{"id":"c",' + tail) == b'{"id":"c","choices":[{"index":0,"delta":{'
    assert learn(b'{"id": "c",' + tail) is None  # a space
    assert learn(b'{"id":"c","id":"c",' + tail) is None  # a key twice
    assert learn(b'{"\\u0069d":"c",' + tail) is None  # an escaped key
    assert learn(b'{"usage":null,' + tail) is None  # a key strip_chunk takes out
    assert learn(b'{"id":"c","choices":[{"delta":{},"index":0}]}') is None
