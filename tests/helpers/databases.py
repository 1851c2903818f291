"""The test databases (a pytest plugin, loaded by tests/conftest.py): the real Postgres on
127.0.0.1:5432 (``TRACETAP_TEST_PG`` to change it), a fresh database per test, and
``db_url``, which runs a test on SQLite and on Postgres (there a copy of one migrated
database, ``migrated_postgres``). Postgres tests skip only when it is unreachable and CI
is not set; in CI they fail.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import asyncpg
import pytest

from tracetap.migrations import upgrade

PG_ADMIN = os.environ.get("TRACETAP_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


def _postgres_available() -> bool:
    async def probe():
        conn = await asyncpg.connect(_asyncpg_dsn(PG_ADMIN), timeout=3)
        await conn.close()

    try:
        asyncio.run(probe())
        return True
    except (OSError, asyncpg.PostgresError, asyncio.TimeoutError):
        return False


def _asyncpg_dsn(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://")


def create_postgres_database(template: str | None = None) -> str:
    """A new database on the test server (empty, or a copy of ``template``'s database);
    returns its URL. Its commits do not wait for the WAL's fsync: the server is shared,
    nothing here outlives it, and a test's writer commits hundreds of times."""
    name = f"tracetap_test_{uuid.uuid4().hex[:12]}"
    copy = "" if template is None else f' TEMPLATE "{template.rsplit("/", 1)[1]}"'

    async def create():
        conn = await asyncpg.connect(_asyncpg_dsn(PG_ADMIN))
        try:
            await conn.execute(f'CREATE DATABASE "{name}"{copy}')
            await conn.execute(f'ALTER DATABASE "{name}" SET synchronous_commit = off')
        finally:
            await conn.close()

    asyncio.run(create())
    return PG_ADMIN.rsplit("/", 1)[0] + "/" + name


def drop_postgres_database(url: str) -> None:
    name = url.rsplit("/", 1)[1]

    async def drop():
        conn = await asyncpg.connect(_asyncpg_dsn(PG_ADMIN))
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    asyncio.run(drop())


@pytest.fixture(scope="session")
def postgres_ok() -> bool:
    ok = _postgres_available()
    if not ok and os.environ.get("CI"):
        pytest.fail(f"Postgres is required in CI and is not reachable at {PG_ADMIN}")
    return ok


@pytest.fixture
def postgres(postgres_ok) -> None:
    """Skips the test when no Postgres is reachable (postgres_ok fails it in CI)."""
    if not postgres_ok:
        pytest.skip("no Postgres reachable (allowed only outside CI)")


@pytest.fixture
def fresh_postgres(postgres) -> Iterator[str]:
    url = create_postgres_database()
    try:
        yield url
    finally:
        drop_postgres_database(url)


@pytest.fixture(scope="session")
def _migrated_template(postgres_ok) -> Iterator[str | None]:
    """A database migrated once, that ``migrated_postgres`` copies (a copy is one
    statement; migrating takes every revision's commits)."""
    if not postgres_ok:
        yield None
        return
    url = create_postgres_database()
    try:
        upgrade(url)
        yield url
    finally:
        drop_postgres_database(url)


@pytest.fixture
def migrated_postgres(postgres, _migrated_template) -> Iterator[str]:
    """A new database at the head revision, with nothing in it."""
    url = create_postgres_database(template=_migrated_template)
    try:
        yield url
    finally:
        drop_postgres_database(url)


@pytest.fixture(scope="session")
def _sqlite_schema(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("schema") / "tracetap.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def migrated_sqlite(_sqlite_schema: Path) -> Callable[[Path], str]:
    """Factory: an empty, migrated SQLite database at ``path``; returns its URL. A copy of
    one migrated once per session: migrating costs about a second, most of a proxy test's
    setup, and the copy is the same file (test_migrations.py tests the migrations)."""

    def make(path: Path) -> str:
        shutil.copyfile(_sqlite_schema, path)
        return f"sqlite:///{path}"

    return make


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path: Path) -> Iterator[str]:
    """An empty, migrated database of each kind."""
    if request.param == "sqlite":
        yield request.getfixturevalue("migrated_sqlite")(tmp_path / "tracetap.db")
    else:
        yield request.getfixturevalue("migrated_postgres")

