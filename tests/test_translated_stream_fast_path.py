"""The proxy hands the stream translators chunks read straight from the upstream's bytes
(``read_chunk_bytes``, decoded in C); the tests and other callers hand them decoded JSON.
Both must translate to the same events, for both APIs."""

from __future__ import annotations

import msgspec
import pytest
from helpers.chat_upstreams import CHAT_USAGE, stream_chunks

from tracetap.proxy.apis.chat.reply import read_chunk_bytes
from tracetap.proxy.apis.messages import translate as messages
from tracetap.proxy.apis.responses import translate as responses

REQUESTS = {messages: {"model": "m", "max_tokens": 64, "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]},
            responses: {"model": "m", "input": "hi", "stream": True}}
CHUNKS = stream_chunks(text="The answer is 42.", reasoning="Think first.",
                       calls=[("call-1", "lookup", '{"q": "x"}')], finish="tool_calls",
                       usage=CHAT_USAGE)


def _events(api, chunks) -> list[dict]:
    translator = api.StreamTranslator(REQUESTS[api], response_id="fixed_id")
    raw = [event for chunk in chunks for event in translator.feed(chunk)]
    raw += translator.finish()
    # Only the creation time may differ between two translators.
    return [{k: v for k, v in msgspec.json.decode(e.split(b"\ndata: ", 1)[1]).items()
             if k != "sequence_number"} for e in raw]


@pytest.mark.parametrize("api", [messages, responses], ids=["messages", "responses"])
def test_chunks_read_from_bytes_translate_like_decoded_chunks(api):
    from_bytes = [read_chunk_bytes(msgspec.json.encode(c),
                                   logprobs=api.StreamTranslator(REQUESTS[api]).wants_logprobs)
                  for c in CHUNKS]
    decoded = _events(api, CHUNKS)
    assert len(decoded) > 6
    assert _strip_times(_events(api, from_bytes)) == _strip_times(decoded)


def _strip_times(events: list[dict]) -> list[dict]:
    def clean(value):
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if k not in ("created_at",)}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value
    return clean(events)
