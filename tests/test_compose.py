"""One function composes the proxy's state (proxy/server/compose.py): every part is given what
it reads when it is built, so what the app learns later (the upstream's flavor, found
after the start) reaches every reader without anything being set on them."""

from __future__ import annotations

import asyncio
import inspect

from tracetap.proxy.runtime.settings import Settings
from tracetap.proxy.server import app as app_module
from tracetap.proxy.server.compose import compose_state


def test_the_parts_share_what_they_read_from_one_composition(tmp_path):
    settings = Settings(upstream=["http://127.0.0.1:9/v1"], upstream_flavor="auto",
                        data_dir=str(tmp_path / "d"), admin_token="t0ken")

    async def go():
        state = await compose_state(settings, {})
        try:
            assert state.flavor == "openai" == state.resolver.flavor()  # until detected
            state.upstream_kind.found("llama-cpp-python")
            # The routing reads state.flavor; the resolver's rule about engines that cut
            # streams reads its own flavor: both see the detected kind.
            assert state.flavor == "llama-cpp-python" == state.resolver.flavor()
            upstream = state.pool.primary.base_url
            assert state.resolver.traffic(upstream) is state.pool.primary.traffic
            assert state.resolver.address(upstream) == "http://127.0.0.1:9/v1"
            assert state.writer.prepare is state.resolver
            assert state.controls.gate is state.gate
            assert state.admin_token == "t0ken"
        finally:
            await state.pool.client.close()
            await state.engine.dispose()

    asyncio.run(go())


def test_a_configured_flavor_holds_from_the_start(tmp_path):
    settings = Settings(upstream=["http://127.0.0.1:9/v1"], upstream_flavor="sglang",
                        data_dir=str(tmp_path / "d"), admin_token="t0ken")

    async def go():
        state = await compose_state(settings, {})
        try:
            assert state.flavor == "sglang" == state.resolver.flavor()
        finally:
            await state.pool.client.close()
            await state.engine.dispose()

    asyncio.run(go())


def test_the_app_lifecycle_sets_nothing_on_the_parts_it_was_given():
    source = inspect.getsource(app_module)
    assert "setattr" not in source and "resolver." not in source.replace(
        "state.resolver.identify", "")
