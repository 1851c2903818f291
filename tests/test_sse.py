"""The incremental SSE parser yields the same events however the bytes are split."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tracetap.proxy.http.sse import SSEParser

STREAM = (
    b'data: {"a": 1}\n\n: keep-alive\n\ndata: {"b":\ndata: 2}\r\n\r\nevent: x\ndata: [DONE]\n\n'
)


def _parse(pieces: list[bytes]) -> list:
    parser = SSEParser()
    events = [e for piece in pieces for e in parser.feed(piece)]
    tail = parser.flush()
    return events + ([tail] if tail else [])


def test_events_and_data():
    events = _parse([STREAM])
    assert [e.data for e in events] == [b'{"a": 1}', None, b'{"b":\n2}', b"[DONE]"]
    assert b"".join(e.raw for e in events) == STREAM


def test_unterminated_tail_is_flushed():
    parser = SSEParser()
    assert parser.feed(b"data: 1\n\ndata: 2") == [(b"data: 1\n\n", b"1")]
    assert parser.flush() == (b"data: 2", b"2")


def test_an_event_without_boundary_does_not_grow_without_bound():
    parser = SSEParser(max_event_bytes=100)
    events = parser.feed(b"data: " + b"x" * 500)
    assert parser.oversized == 1 and events[0].data is None
    assert parser.feed(b"\n\ndata: ok\n\n")[-1].data == b"ok"


# LF only, as engines send it: reads that start on an event boundary take a faster path.
LF_STREAM = (
    b'data: {"a": 1}\n\n: keep-alive\n\n\n\ndata: {"b":\ndata: 2}\n\n'
    b"event: x\ndata: [DONE]\n\n\ndata:no-space\n\n"
)


def test_lf_events_and_data():
    events = _parse([LF_STREAM])
    assert [e.data for e in events] == [
        b'{"a": 1}',
        None,
        None,
        b'{"b":\n2}',
        b"[DONE]",
        b"no-space",
    ]
    assert b"".join(e.raw for e in events) == LF_STREAM


@given(st.sampled_from([STREAM, LF_STREAM]), st.lists(st.integers(0, 1 << 10), max_size=12))
def test_any_split_gives_the_same_events(stream, cuts):
    """Whole, an LF stream takes the split path; cut mid-event, the regex path."""
    cuts = sorted({c % (len(stream) + 1) for c in cuts})
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
    assert _parse(pieces) == _parse([stream])


def test_reads_of_one_event_each_give_the_same_events():
    """A paced engine's reads are one event each (the parser's no-copy path): the same
    events as one read of the whole stream, an event split over reads or an odd one
    (a comment, two data lines, no space, CR line ends) included."""
    stream = (LF_STREAM + b'data: {"c": 3}\n\ndata: x\r\n\ndata: \n\n'
              + b'data: {"d": 4}\n\ndata: {"e"' + b': 5}\n\n')
    reads = [part + b"\n\n" for part in stream.split(b"\n\n")[:-1]]
    assert _parse(reads) == _parse([stream])
    assert [e.data for e in _parse(reads)][-4:] == [b"x", b"", b'{"d": 4}', b'{"e": 5}']


_USUAL = st.lists(st.binary(max_size=24).map(
    lambda b: b"data: " + b.replace(b"\n", b"").replace(b"\r", b"") + b"\n\n"), min_size=1,
    max_size=8)
_ODD = st.sampled_from([b"", b"data: x", b": ping\n\n", b"\n\n", b"data: a\ndata: b\n\n", b"\n",
                        b"data:x\n\n", b"event: e\ndata: 1\n\n", b"data: y\n\n\n"])


@given(_USUAL, _ODD, st.lists(st.integers(0, 1 << 10), max_size=6))
def test_a_read_of_whole_one_line_events_gives_the_events_of_any_split(usual, odd, cuts):
    """A read of whole one-line data events (an engine ahead of the proxy) is split on
    its line ends at once; anything else in the read takes the event-by-event split.
    Either way, the events of the same bytes cut anywhere (the regex path)."""
    stream = b"".join(usual) + odd
    cuts = sorted({c % (len(stream) + 1) for c in cuts})
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
    whole = _parse([stream])
    assert whole == _parse(pieces)
    assert b"".join(e.raw for e in whole) == stream
    assert [e.data for e in whole[:len(usual)]] == [e[6:-2] for e in usual]
