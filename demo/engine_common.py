"""What the mock engine's modules share: its configuration, errors, the abort count.

``demo/engine.py`` serves the model endpoints, ``demo/engine_info.py`` the tokenizer and
info ones; both answer errors through ``ApiError`` and count requests a client cut
(``Aborts``: closing the connection is how vLLM is told to abort a request).
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from tracetap.demo.wire import FLAVORS, Flavor


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True):
    flavor: Flavor = "vllm"
    model: str = "mock-model"
    max_tokens_default: int = 256  # byte-level tool calls are ~50 tokens: keep headroom
    tool_rounds: int = 2
    chunk_delay_s: float = 0.0
    max_model_len: int = 32768
    bad_tool_args: float = 0.0  # seeded failure mode: this fraction of tool calls is invalid
    tool_preface: float = 0.5  # the share of tool calls with a sentence before them
    routed_experts: bool = False  # vLLM's --enable-return-routed-experts (demo/experts.py)

    def __post_init__(self) -> None:
        if not 0.0 <= self.bad_tool_args <= 1.0:
            raise ValueError("bad_tool_args is a fraction in [0, 1]")
        if not 0.0 <= self.tool_preface <= 1.0:
            raise ValueError("tool_preface is a fraction in [0, 1]")
        if self.flavor not in FLAVORS:
            raise ValueError(f"unknown engine flavor {self.flavor!r}")


CONFIG = web.AppKey("engine_config", EngineConfig)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def json_response(body: Any, status: int = 200) -> web.Response:
    data = msgspec.json.encode(body)
    return web.Response(body=data, status=status, content_type="application/json")



class Aborts:
    """Requests whose client went away before the answer ended (the engine stopped
    generating for them: vLLM aborts a request when its connection closes)."""

    def __init__(self) -> None:
        self.count = 0


ABORTS = web.AppKey("aborts", Aborts)
