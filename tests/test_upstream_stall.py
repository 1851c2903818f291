"""A streamed reply's stall timeout (``--upstream-timeout`` as aiohttp's ``sock_read``),
watched a few times a timeout (proxy.upstream.stall) rather than re-armed per read: a
stream whose upstream goes quiet for the timeout is cut and recorded as the upstream's
failure; one that keeps sending, however slowly, is not; time the proxy spends not
reading (its client slow) does not count against the upstream."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.proxy.runtime.settings import Settings
from tracetap.proxy.upstream import stall
from tracetap.proxy.upstream.stall import StallWatch


def _proxy(loop_thread, engine, db_url, tmp_path, timeout: float) -> Proxy:
    settings = Settings(upstream=engine.url, db=db_url, data_dir=str(tmp_path / "d"),
                        port=free_port(), upstream_timeout=timeout)
    return Proxy(loop_thread, settings).start()


def _stream(proxy: Proxy, episode: str, chunk_delay: float, tokens: int) -> list:
    client = openai.OpenAI(base_url=proxy.episode_url(episode), api_key="x", max_retries=0)
    with client:
        return list(client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
            extra_body={"mock_chunk_delay_s": chunk_delay,
                        "mock_completion_tokens": tokens}))


def test_a_stream_whose_upstream_goes_quiet_is_cut_at_the_timeout(loop_thread, engine, db_url,
                                                                  tmp_path):
    proxy = _proxy(loop_thread, engine, db_url, tmp_path, timeout=0.3)
    try:
        began = time.monotonic()
        with pytest.raises(openai.APIConnectionError):
            _stream(proxy, "quiet", chunk_delay=3.0, tokens=4)
        # Cut within the timeout and a slice of it (plus a loaded machine's slack), long
        # before the engine's next chunk.
        assert time.monotonic() - began < 2.0
        [call] = proxy.calls("quiet")
        assert call["status"] == "upstream_error"
        assert "Timeout on reading data from socket" in call["error"]
    finally:
        proxy.stop()


def test_a_slow_stream_that_keeps_sending_is_not_cut(loop_thread, engine, db_url, tmp_path):
    proxy = _proxy(loop_thread, engine, db_url, tmp_path, timeout=0.5)
    try:
        # 8 chunks 0.2 s apart: 1.6 s in all, over three timeouts, never one quiet.
        chunks = _stream(proxy, "slow", chunk_delay=0.2, tokens=8)
        assert any(c.choices and c.choices[0].finish_reason for c in chunks)  # to its end
        [call] = proxy.calls("slow")
        assert call["status"] == "ok"
    finally:
        proxy.stop()


class _Content:
    def __init__(self):
        self.total_bytes = 0
        self.error: BaseException | None = None
        self.eof = False

    def is_eof(self) -> bool:
        return self.eof

    def exception(self):
        return self.error

    def set_exception(self, exc: BaseException) -> None:
        self.error = exc


class _Protocol:
    read_timeout = 5.0
    _reading_paused = False


class _Connection:
    def __init__(self):
        self.protocol = _Protocol()


class _Response:
    def __init__(self):
        self.content, self.connection = _Content(), _Connection()


def _watch(seconds: float, feed) -> tuple[_Response, float]:
    """A watch over a fake reply that ``feed(response, elapsed)`` changes as time goes:
    (the reply, when its read was ended or None)."""
    async def run():
        response = _Response()
        watch = StallWatch(response, seconds)
        assert response.connection.protocol.read_timeout is None  # aiohttp's timer is off
        began = asyncio.get_running_loop().time()
        ended = None
        while asyncio.get_running_loop().time() - began < seconds * 4:
            elapsed = asyncio.get_running_loop().time() - began
            if response.content.error is not None:
                ended = elapsed
                break
            feed(response, elapsed)
            await asyncio.sleep(seconds / stall.SLICES / 4)
        watch.stop()
        return response, ended
    return asyncio.run(run())


def test_the_watch_ends_a_quiet_read_within_a_slice_of_the_timeout():
    response, ended = _watch(0.4, lambda response, elapsed: None)
    assert ended is not None and 0.4 <= ended < 0.4 * (1 + 2 / stall.SLICES) + 0.2
    assert "Timeout on reading" in str(response.content.error)


def test_bytes_arriving_keep_the_read_alive():
    def feed(response, elapsed):
        response.content.total_bytes += 1
    _, ended = _watch(0.4, feed)
    assert ended is None


def test_time_the_proxy_paused_reading_does_not_count():
    def feed(response, elapsed):  # the client is slow: the proxy stopped reading
        response.connection.protocol._reading_paused = True
    _, ended = _watch(0.4, feed)
    assert ended is None


def test_a_finished_body_is_not_watched():
    def feed(response, elapsed):
        response.content.eof = True
    _, ended = _watch(0.4, feed)
    assert ended is None
