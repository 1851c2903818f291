"""Throwaway Postgres databases for one benchmark run (created fresh, dropped after)."""

from __future__ import annotations

import asyncio
import os
import secrets

import asyncpg

PG_ADMIN = os.environ.get("TRACETAP_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


async def _admin(sql: str) -> None:
    conn = await asyncpg.connect(PG_ADMIN)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def create_database() -> str:
    name = f"tracetap_bench_{secrets.token_hex(6)}"
    asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    return PG_ADMIN.rsplit("/", 1)[0] + "/" + name


def drop_database(url: str) -> None:
    asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)'))
