"""An overlay's additions do not change the conversation a call is recorded in.

Found trying a runtime patch on vLLM by hand: a patch injecting a system message at every
call (``at="after_system"``) made each call's stored ``conversation`` hash differ (the
first call's start had one system message, the next two: the kept addition and the new
one), so the export took each turn for a new conversation (its own lineage, a second
main line with ``split_reason`` null) instead of one harness conversation.
"""

from __future__ import annotations

import openai
import pytest
from helpers.http import register
from helpers.loop import free_port
from helpers.servers import Proxy

from tracetap.demo.engine import EngineConfig
from tracetap.migrations import upgrade
from tracetap.proxy.runtime.settings import Settings

PATCH = """
async def before_model(request, state):
    return Inject(messages=[{"role": "system", "content": "Use numbers."}],
                  at="after_system", reason="every call")
"""


@pytest.fixture
def engine_config() -> EngineConfig:
    return EngineConfig(flavor="vllm")


@pytest.fixture
def proxy(loop_thread, engine, tmp_path):
    url = f"sqlite:///{tmp_path / 'tracetap.db'}"
    upgrade(url)
    settings = Settings(
        upstream=engine.url, db=url, data_dir=str(tmp_path / "data"), port=free_port()
    )
    p = Proxy(loop_thread, settings).start()
    yield p
    p.stop()


def two_turns(proxy, episode: str) -> None:
    with openai.OpenAI(base_url=proxy.episode_url(episode), api_key="unused", max_retries=0) as sdk:
        messages = [{"role": "user", "content": "Count from 1:"}]
        reply = sdk.chat.completions.create(model="mock-model", seed=1, messages=messages)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": "Go on."},
        ]
        sdk.chat.completions.create(model="mock-model", seed=2, messages=messages)


def test_calls_under_an_injecting_patch_keep_the_harness_conversation(proxy):
    status, reply = proxy.admin("PUT", "/tracetap/overlays/numbers", {"source": PATCH})
    assert status == 201, reply
    register(proxy, "patched", overlay="numbers")
    register(proxy, "plain")
    two_turns(proxy, "patched")
    two_turns(proxy, "plain")
    patched, plain = proxy.calls("patched"), proxy.calls("plain")
    # The model was given the additions (two system messages on the second call)...
    assert [c["upstream_request"].count('"Use numbers."') for c in patched] == [1, 2]
    # ...but every call is recorded in the harness's one conversation, the same as
    # without the overlay.
    assert len({c["conversation"] for c in patched}) == 1
    assert patched[0]["conversation"] == plain[0]["conversation"]
