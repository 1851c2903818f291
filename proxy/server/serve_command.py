"""``tracetap serve``: the proxy's options (proxy/runtime/settings.py), then one process or a
supervisor of ``--workers`` (proxy/server/workers.py).

Importing this module is cheap (the command line builds every subcommand's parser): the
server, the migrations and the database load only inside ``run``.
"""

from __future__ import annotations

import argparse

from tracetap.proxy.server.serve_flags import add_serve_arguments as add_arguments
from tracetap.proxy.server.serve_flags import settings_from_args

__all__ = ["add_arguments", "run"]


def admin_token_note(args: argparse.Namespace, token: str | None) -> str | None:
    """Where a given admin token came from, as the start-up line says it: its file (named
    by flag or variable), the variable, or the flag (a flag's value wins over the
    variable's, so a token equal to the variable's is the variable's); None when none
    was given (then it is the data dir's file)."""
    from tracetap.storage import config

    path = getattr(args, "admin_token_file", None)
    if path:
        via = ("TRACETAP_ADMIN_TOKEN_FILE" if path == config.env("admin_token_file")
               else "--admin-token-file")
        return f"admin token from the file {path} ({via})"
    if not token:
        return None
    if token == config.env("admin_token"):
        return "admin token from TRACETAP_ADMIN_TOKEN"
    return "admin token from --admin-token"


def run(args: argparse.Namespace) -> int:
    from tracetap.migrations import prepare_schema
    from tracetap.proxy.admin.token import ensure_admin_token
    from tracetap.proxy.server import serve
    from tracetap.proxy.server.app import build_app
    from tracetap.proxy.upstream.startup_check import check_upstreams

    settings = settings_from_args(args)
    check_upstreams(settings.upstreams, settings.upstream_api_key)
    prepare_schema(settings.database_url)
    token_note = admin_token_note(args, settings.admin_token) or (
        f"admin token in {ensure_admin_token(settings.data_dir)[1]}")
    if settings.workers > 1:
        from tracetap.proxy.server import workers
        return workers.supervise(settings, args.log_level, token_note)
    app = build_app(settings)
    # Bound before anything is announced: a port in use fails here, with its number.
    sockets, admin_at = serve.listeners(settings)
    print(serve.announcement(settings, admin_at, token_note), flush=True)
    serve.run(app, sockets, settings)
    return 0
