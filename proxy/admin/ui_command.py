"""``tracetap ui``: the trace viewer alone, over a database, without a running proxy.

In proxy/ (not viewer/) because it opens with the proxy's admin token and follows its rule
for non-loopback addresses; the viewer itself imports no proxy (docs/architecture.md).

Importing this module is cheap (the CLI builds every subcommand's parser): the server
and Jinja load only inside ``run``.
"""

from __future__ import annotations

import argparse
import asyncio

from tracetap.storage import config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config.add_location_options(parser, use="to read")
    a = parser.add_argument
    a("--host", default="127.0.0.1",
      help=config.described("address to listen on; a non-loopback address needs "
                             "--admin-token", default="127.0.0.1"))
    a("--port", type=int, default=8090,
      help=config.described("port the viewer listens on", default=8090))
    config.add_option(parser, "--admin-token", metavar="TOKEN",
                      help="the token that opens the viewer; default: the one in "
                           "DATA_DIR/admin-token, generated once")
    a("--detokenize", metavar="URL", default=None,
      help="an engine base URL (vLLM, SGLang, llama.cpp) whose /detokenize gives token text; "
           "without it tokens are shown by id")
    a("--no-search-index", dest="search_index", action="store_false",
      default=config.search_index(),
      help=config.described("the proxy ran with --no-search-index: the search page finds "
                            "episodes by id and says so", var=config.SEARCH_INDEX_VARIABLE,
                            default="on"))


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    from tracetap.proxy.admin.token import ensure_admin_token
    from tracetap.proxy.apis.registry import readers
    from tracetap.proxy.runtime.settings import is_loopback
    from tracetap.storage.engine import redact_url
    from tracetap.storage.scan import Reader, ScanError
    from tracetap.viewer import PREFIX
    from tracetap.viewer.access import Access
    from tracetap.viewer.app import ViewerConfig, build_viewer

    url = config.database_url(args.db, args.data_dir)
    if not is_loopback(args.host) and not args.admin_token:
        raise ValueError(f"refusing to listen on {args.host} without --admin-token: pass the "
                         "token to use over the network explicitly")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be 1-65535, got {args.port}")

    async def check() -> None:
        async with Reader(url):
            pass

    try:
        asyncio.run(check())  # a bad URL or a missing schema fails here, in one line
    except ScanError as exc:
        raise ValueError(str(exc)) from None
    if args.admin_token:
        token, note = args.admin_token, "the token given with --admin-token"
    else:
        token, path = ensure_admin_token(args.data_dir)
        note = f"the admin token in {path} (tracetap admin-token --data-dir {args.data_dir})"
    viewer_config = ViewerConfig(database_url=url, detokenize_url=args.detokenize,
                                 data_dir=str(args.data_dir), search_index=args.search_index)
    app = build_viewer(viewer_config, Access(lambda _request: token), readers(),
                       mounted=False)
    print(f"tracetap ui: http://{args.host}:{args.port}{PREFIX}/ reading {redact_url(url)}; "
          f"log in with {note}", flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None,
                shutdown_timeout=5)
    return 0
