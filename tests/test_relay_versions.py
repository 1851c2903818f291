"""A read's tokens arrived at one instant: the relay judges their policy version once per
read (proxy.call.relay ``_observe``), so a read after a weight sync is unknown whole, not
its first event alone; and a chat stream's events, cut or not, give the client the same
bytes as the exact path."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tracetap.proxy.apis import Injected
from tracetap.proxy.apis.chat.capture import CHAT_API
from tracetap.proxy.apis.chat.inject import strip_chunk
from tracetap.proxy.call.relay import Relay
from tracetap.proxy.call.timings import Timings
from tracetap.proxy.policy.versions import CallVersions

INJECTED = Injected(logprobs=True, usage=True, token_ids=True)
HEAD = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def _event(n: int) -> bytes:
    choice = {"index": 0, "delta": {"content": f"t{n}"},
              "logprobs": {"content": [{"token": f"t{n}", "logprob": -0.5, "bytes": [116],
                                        "top_logprobs": []}]},
              "finish_reason": None, "token_ids": [n]}
    return b"data: " + json.dumps({**HEAD, "choices": [choice]},
                                  separators=(",", ":")).encode() + b"\n\n"


def _relay() -> tuple[Relay, SimpleNamespace, CallVersions]:
    controls = SimpleNamespace(policy_version="v1", serial=0)
    versions = CallVersions(SimpleNamespace(controls=controls, gate=SimpleNamespace(paused=False)))
    versions.admit()
    request = SimpleNamespace(injected=INJECTED, experts=None, client_payload={}, stream=True)
    call = SimpleNamespace(api=CHAT_API, capture=CHAT_API.capture(INJECTED), timings=Timings(),
                           request=request, versions=versions, translation=None,
                           end_reached=lambda: None)
    return Relay(call, rewrite=True), controls, versions


def test_the_tokens_of_a_read_after_a_sync_are_unknown_together():
    relay, controls, versions = _relay()
    pieces = [*relay.chunk(_event(1)), *relay.chunk(_event(2))]
    controls.serial, controls.policy_version = 1, "v2"  # a sync between two reads
    pieces += relay.chunk(_event(3) + _event(4) + _event(5))
    pieces += relay.chunk(_event(6))
    [choice] = relay.capture.choices()
    versions.stamp([choice])
    assert choice.completion_ids == [1, 2, 3, 4, 5, 6]
    assert choice.policy_spans == [(0, "v1"), (2, None), (5, "v2")]
    expected = b"".join(b"data: " + strip_chunk(_event(n)[6:-2], INJECTED) + b"\n\n"
                        for n in range(1, 7))
    assert b"".join(pieces) == expected


def test_a_stream_read_event_by_event_is_the_stream_read_whole():
    """A read of one token chunk takes the relay's short path (``Relay._one``); a read of
    several, the exact one: the client's bytes, the capture and the spans agree, the end
    marker and a chunk that does not decode included."""
    bad = b'data: {"id":"c","choices":[{"index":0,"delta":\n\n'
    events = [_event(n) for n in range(1, 6)] + [bad, _event(6), b"data: [DONE]\n\n"]
    one, _, one_versions = _relay()
    pieces = [piece for data in events for piece in one.chunk(data)]
    whole, _, whole_versions = _relay()
    expected = [*whole.chunk(b"".join(events))]
    assert b"".join(pieces) == b"".join(expected)
    assert bad in b"".join(pieces) and b"".join(pieces).endswith(b"data: [DONE]\n\n")
    assert one.done and whole.done
    [a], [b] = one.capture.choices(), whole.capture.choices()
    one_versions.stamp([a])
    whole_versions.stamp([b])
    assert a.completion_ids == b.completion_ids == [1, 2, 3, 4, 5, 6]
    assert a.completion_logprobs == b.completion_logprobs
    assert a.policy_spans == b.policy_spans is None
    assert one.capture.errors == whole.capture.errors and one.capture.errors
