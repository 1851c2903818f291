"""Tokenizer questions over kept-alive connections (proxy.upstream.lean_http): the answer
is the engine's bytes exactly, or the question goes through aiohttp instead."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from tracetap.proxy.upstream.client import UpstreamClient
from tracetap.proxy.upstream.lean_http import LeanPoster


class Engine:
    """An aiohttp server answering POST /echo with what it was sent (and the socket it came
    on), /big with 2 MB, /chunked chunked, /slow after a while, /fail with a 500."""

    def __init__(self, keepalive: float = 75.0):
        self.keepalive = keepalive
        self.peers: list[tuple] = []
        self.headers: list[dict] = []

    async def __aenter__(self) -> Engine:
        app = web.Application()
        app.router.add_post("/echo", self.echo)
        app.router.add_post("/big", self.big)
        app.router.add_post("/chunked", self.chunked)
        app.router.add_post("/slow", self.slow)
        app.router.add_post("/fail", self.fail)
        self.runner = web.AppRunner(app, keepalive_timeout=self.keepalive)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.origin = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()

    async def echo(self, request: web.Request) -> web.Response:
        self.peers.append(request.transport.get_extra_info("peername"))
        self.headers.append(dict(request.headers))
        return web.Response(body=b'{"got":' + await request.read() + b"}",
                            content_type="application/json")

    async def big(self, request: web.Request) -> web.Response:
        return web.Response(body=BIG)

    async def chunked(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(b'{"a":')
        await response.write(b"1}")
        await response.write_eof()
        return response

    async def slow(self, request: web.Request) -> web.Response:
        await asyncio.sleep(float(await request.read()))
        return web.Response(body=b"late")

    async def fail(self, request: web.Request) -> web.Response:
        return web.Response(status=500, body=b'{"error":"x"}')


BIG = b"[" + b",".join(str(i).encode() for i in range(300_000)) + b"]"


def test_an_answer_is_the_engines_bytes_and_the_connection_is_kept():
    async def run():
        async with Engine() as engine:
            lean = LeanPoster({"Authorization": "Bearer k"})
            first = await lean.post(engine.origin + "/echo", b"[1]", 5)
            assert sum(map(len, lean._idle.values())) == 1
            second = await lean.post(engine.origin + "/echo", b'"x"', 5)
            big = await lean.post(engine.origin + "/big", b"{}", 5)
            failed = await lean.post(engine.origin + "/fail", b"{}", 5)
            lean.close()
            return engine, first, second, big, failed

    engine, first, second, big, failed = asyncio.run(run())
    assert first == (200, b'{"got":[1]}') and second == (200, b'{"got":"x"}')
    assert big == (200, BIG)  # many reads, one answer
    assert failed == (500, b'{"error":"x"}')
    assert engine.peers[0] == engine.peers[1]  # one connection for both
    assert engine.headers[0]["Authorization"] == "Bearer k"
    assert engine.headers[0]["Content-Type"] == "application/json"
    assert engine.headers[0]["Accept"] == "*/*"  # what aiohttp sends


def test_a_chunked_answer_is_asked_through_aiohttp():
    async def run():
        async with Engine() as engine:
            lean = LeanPoster({})
            plain = await lean.post(engine.origin + "/chunked", b"{}", 5)
            # that engine's answers are not plain: its next questions are not asked here
            # (then again through aiohttp), whatever the path
            after = await lean.post(engine.origin + "/echo", b"1", 5)
            asked = len(engine.peers)
            client = UpstreamClient(timeout=5, connect_timeout=5, max_connections=4)
            await client.start()
            try:
                return plain, after, asked, \
                    await client.post_raw(engine.origin + "/chunked", b"{}"), \
                    await client.post_json(engine.origin + "/chunked", {}), \
                    await client.post_raw(engine.origin + "/echo", b"2"), len(engine.peers)
            finally:
                await client.close()
                lean.close()

    plain, after, asked, raw, decoded, echoed, asked_then = asyncio.run(run())
    assert plain is None and after is None and asked == 0  # not read, nor asked, here
    assert raw == (200, b'{"a":1}') and decoded == (200, {"a": 1})
    assert echoed == (200, b'{"got":2}') and asked_then == 1  # asked once, through aiohttp


def test_a_connection_the_engine_closed_while_idle_is_not_used():
    async def run():
        async with Engine(keepalive=0.05) as engine:
            lean = LeanPoster({})
            first = await lean.post(engine.origin + "/echo", b"1", 5)
            await asyncio.sleep(0.3)  # the engine closes the kept connection
            second = await lean.post(engine.origin + "/echo", b"2", 5)
            lean.close()
            return engine, first, second

    engine, first, second = asyncio.run(run())
    assert (first, second) == ((200, b'{"got":1}'), (200, b'{"got":2}'))
    assert engine.peers[0] != engine.peers[1]


def test_a_question_past_its_timeout_answers_nothing_and_its_late_answer_is_never_read():
    async def run():
        async with Engine() as engine:
            lean = LeanPoster({})
            late = await lean.post(engine.origin + "/slow", b"0.3", 0.05)
            task = asyncio.ensure_future(lean.post(engine.origin + "/slow", b"0.2", 5))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.4)  # both late answers would have come by now
            after = await lean.post(engine.origin + "/echo", b"3", 5)
            lean.close()
            return late, after

    late, after = asyncio.run(run())
    assert late == (0, None)
    assert after == (200, b'{"got":3}')  # not "late": those connections were closed


async def _raw_server(answer: bytes) -> tuple[asyncio.Server, str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
            await asyncio.sleep(0.5)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/x"


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA",  # more than the answer
    b"HTTP/1.1 200 OK\r\n\r\nok",  # no Content-Length: read to the close
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\nok",
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/2 200\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nok",  # closed before the answer's end
    b"junk\r\n\r\n",
])
def test_an_answer_it_does_not_read_plainly_goes_to_aiohttp(answer):
    async def run():
        server, url = await _raw_server(answer)
        lean = LeanPoster({})
        try:
            return await lean.post(url, b"{}", 2)
        finally:
            lean.close()
            server.close()
            await asyncio.sleep(0.6)  # the server's side closes too

    assert asyncio.run(run()) is None


def test_a_plain_answer_from_a_bare_server_is_read():
    async def run():
        server, url = await _raw_server(
            b"HTTP/1.0 201 Created\r\ncontent-length:  4 \r\nConnection: close\r\n\r\n[1,2")
        lean = LeanPoster({})
        try:
            answer = await lean.post(url, b"{}", 2)
            return answer, sum(map(len, lean._idle.values()))
        finally:
            lean.close()
            server.close()
            await asyncio.sleep(0.6)

    answer, kept = asyncio.run(run())
    assert answer == (201, b"[1,2") and kept == 0  # HTTP/1.0: not kept


@pytest.mark.parametrize("url", ["https://127.0.0.1:1/x", "http://u:p@127.0.0.1:1/x",
                                 "http://127.0.0.1:99999/x"])
def test_tls_credentials_and_odd_urls_go_to_aiohttp(url):
    assert asyncio.run(LeanPoster({}).post(url, b"{}", 1)) is None


def test_an_engine_that_is_down_answers_status_0():
    async def run():
        client = UpstreamClient(timeout=5, connect_timeout=1, max_connections=4)
        await client.start()
        try:
            return await client.post_raw("http://127.0.0.1:9/tokenize", b"{}", 1)
        finally:
            await client.close()

    assert asyncio.run(run()) == (0, None)
