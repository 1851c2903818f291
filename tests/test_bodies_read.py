"""read_body: a body that has arrived is taken without waiting; one still arriving is
waited for, a read at a time, under the stall timeout."""

import asyncio
from types import SimpleNamespace
from unittest import mock

import pytest
from aiohttp.streams import StreamReader
from multidict import CIMultiDict

from tracetap.proxy.http import bodies
from tracetap.proxy.http.errors import ProxyError


def _request(content: StreamReader, length: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(headers=CIMultiDict(), content_length=length, body_exists=True,
                           content=content)


def _reader() -> StreamReader:
    protocol = mock.Mock(_reading_paused=False)
    return StreamReader(protocol, 2**16, loop=asyncio.get_running_loop())


def test_an_arrived_body_is_read_without_a_wait():
    asyncio.run(_an_arrived_body_is_read_without_a_wait())


async def _an_arrived_body_is_read_without_a_wait():
    content = _reader()
    content.feed_data(b'{"model": ')
    content.feed_data(b'"m"}')
    content.feed_eof()
    with mock.patch.object(bodies.asyncio, "wait_for", side_effect=AssertionError("waited")):
        assert await bodies.read_body(_request(content), 1 << 20, 5.0) == b'{"model": "m"}'


def test_a_body_still_arriving_is_waited_for():
    asyncio.run(_a_body_still_arriving_is_waited_for())


async def _a_body_still_arriving_is_waited_for():
    content = _reader()
    content.feed_data(b'{"model": ')

    async def rest():
        await asyncio.sleep(0.01)
        content.feed_data(b'"m"}')
        await asyncio.sleep(0.01)
        content.feed_eof()

    task = asyncio.create_task(rest())
    assert await bodies.read_body(_request(content), 1 << 20, 5.0) == b'{"model": "m"}'
    await task


def test_an_arrived_body_past_the_limit_is_a_413():
    asyncio.run(_an_arrived_body_past_the_limit_is_a_413())


async def _an_arrived_body_past_the_limit_is_a_413():
    content = _reader()
    content.feed_data(b"x" * 100)
    content.feed_eof()
    with pytest.raises(ProxyError) as raised:
        await bodies.read_body(_request(content), 50, 5.0)
    assert raised.value.status == 413


def test_a_body_that_stalls_after_its_first_part_is_a_408():
    asyncio.run(_a_body_that_stalls_after_its_first_part_is_a_408())


async def _a_body_that_stalls_after_its_first_part_is_a_408():
    content = _reader()
    content.feed_data(b'{"model": ')
    with pytest.raises(ProxyError) as raised:
        await bodies.read_body(_request(content), 1 << 20, 0.05)
    assert raised.value.status == 408
