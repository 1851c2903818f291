"""``tracetap admin-token``: print the admin token ``serve`` generated in --data-dir."""

from __future__ import annotations

import argparse

from tracetap.storage import config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config.add_option(parser, "--data-dir", metavar="DIR", default=config.DEFAULT_DATA_DIR,
                      help=config.DATA_DIR_HELP)


def run(args: argparse.Namespace) -> int:
    from tracetap.proxy.admin.token import read_admin_token, token_path

    token = read_admin_token(args.data_dir)
    if token is None:
        raise ValueError(f"no admin token at {token_path(args.data_dir)}: start "
                         "`tracetap serve` with this --data-dir once, or pass --admin-token")
    print(token)
    return 0
