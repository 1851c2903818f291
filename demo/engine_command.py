"""``tracetap mock-engine``: its options, and the engine started from them.

Importing this module is cheap (the CLI builds every subcommand's parser): the server
loads only inside ``run``.
"""

from __future__ import annotations

import argparse

from tracetap.demo.wire import FLAVORS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--host", default="127.0.0.1", help="address to listen on [default 127.0.0.1]")
    a("--port", type=int, default=8000, help="port to listen on [default 8000]")
    a(
        "--flavor",
        choices=FLAVORS,
        default="vllm",
        help="which engine's wire behaviour to imitate (docs/mock-engine.md) [default vllm]",
    )
    a("--model", default="mock-model", help="the model name it serves [default mock-model]")
    a(
        "--tool-rounds",
        type=int,
        default=2,
        metavar="N",
        help="tool calls the scripted model makes before its final answer [default 2]",
    )
    a(
        "--max-tokens-default",
        type=int,
        default=256,
        metavar="N",
        help="completion tokens when a request sets no max_tokens [default 256]",
    )
    a(
        "--chunk-delay-s",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="pause between streamed chunks [default 0.0]",
    )
    a(
        "--bad-tool-args",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="seeded failure mode: this fraction of tool calls gets arguments that break "
        "the tool's schema [default 0.0]",
    )
    a(
        "--routed-experts",
        action="store_true",
        help="return each token's MoE routing, as vLLM with --enable-return-routed-experts "
        "[default off]",
    )


def run(args: argparse.Namespace) -> int:
    from tracetap.demo.engine import EngineConfig, run_engine

    config = EngineConfig(
        flavor=args.flavor,
        model=args.model,
        tool_rounds=args.tool_rounds,
        max_tokens_default=args.max_tokens_default,
        chunk_delay_s=args.chunk_delay_s,
        bad_tool_args=args.bad_tool_args,
        routed_experts=args.routed_experts,
    )
    run_engine(args.host, args.port, config)
    return 0
