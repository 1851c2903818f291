"""continuation.cuttable cancels the call's own task for a weight sync's cut: the cut's
cancel is taken back and the body sent again; a cancel of any other origin arriving with
it (the deadline, the proxy stopping) still ends the call."""

import asyncio
from types import SimpleNamespace

import pytest

from tracetap.proxy.call import continuation


def _call():
    gate = SimpleNamespace(cuts=set())
    return SimpleNamespace(request=SimpleNamespace(stream=False),
                           services=SimpleNamespace(gate=gate)), gate


def test_a_cut_send_is_sent_again_and_the_task_is_not_left_cancelling(monkeypatch):
    async def scenario():
        call, gate = _call()
        sent, again = [], []

        async def send():
            sent.append(True)
            if len(sent) == 1:
                await asyncio.sleep(10)  # waits for the engine: cut meanwhile
            return "reply"

        async def resumed(c):
            again.append(c)

        monkeypatch.setattr(continuation, "_again", resumed)
        task = asyncio.create_task(continuation.cuttable(call, send))
        while not sent:  # the request is out, waiting for the engine
            await asyncio.sleep(0)
        for cut in list(gate.cuts):
            cut()
        result = await task
        return result, len(sent), again == [call], gate.cuts, task.cancelling()

    assert asyncio.run(scenario()) == ("reply", 2, True, set(), 0)


def test_another_cancel_arriving_with_the_cut_still_ends_the_call(monkeypatch):
    async def scenario():
        call, gate = _call()

        sent = []

        async def send():
            sent.append(True)
            await asyncio.sleep(10)

        async def resumed(c):
            raise AssertionError("sent again despite the other cancel")

        monkeypatch.setattr(continuation, "_again", resumed)
        task = asyncio.create_task(continuation.cuttable(call, send))
        while not sent:
            await asyncio.sleep(0)
        task.cancel()  # the proxy stopping, in the same pass as the cut
        for cut in list(gate.cuts):
            cut()
        with pytest.raises(asyncio.CancelledError):
            await task
        return gate.cuts

    assert asyncio.run(scenario()) == set()


def test_the_deadline_still_fires_while_a_send_waits():
    async def scenario():
        call, _ = _call()

        async def send():
            await asyncio.sleep(10)

        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await continuation.cuttable(call, send)

    asyncio.run(scenario())
