"""Export to object storage (docs/export.md): a local S3 server (moto's standalone server),
incremental runs, a run killed between its data files and its manifest, and reading
back through pyarrow's S3 filesystem, using only the files the manifest lists.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import fsspec
import pyarrow.parquet as pq
import pytest
from helpers.objectstore import (
    KEY_ID,
    SECRET,
    MotoServer,
    environ_without_aws,
    listed_rows,
    moto_server,
    stored_files,
)

from tests.test_export_runs import _db, calls, finish
from tracetap.exporters import ExportError, export, objectstore

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def s3() -> MotoServer:
    with moto_server() as server:
        yield server


@pytest.fixture
def s3_env(s3, monkeypatch) -> MotoServer:
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    return s3


def episodes(url: str, *names: str) -> None:
    """Episodes of two turns (the second sampled twice), finished with rewards."""
    _db(url, *(calls(n, turns=2, last_n=2) for n in names),
        *(finish(n, float(i)) for i, n in enumerate(names)))


def db_calls(url: str) -> set[str]:
    import asyncio

    from sqlalchemy import text

    from tracetap.storage.engine import create_engine

    async def read():
        engine = create_engine(url)
        try:
            async with engine.connect() as conn:
                return {r[0] for r in await conn.execute(text("SELECT call_id FROM calls"))}
        finally:
            await engine.dispose()

    return asyncio.run(read())


def call_keys(rows: list[dict]) -> list[tuple[str, int]]:
    return sorted((r["call_id"], r["choice_index"]) for r in rows)


def test_incremental_export_to_s3_reads_back_exactly(db_url, s3_env, tmp_path):
    bucket = s3_env.bucket()
    uri, fs, base = f"s3://{bucket}/runs/data", s3_env.filesystem(), f"{bucket}/runs/data"
    episodes(db_url, "a", "b")
    first = export(db_url, uri, incremental=True)
    assert (first.episodes, first.out) == (2, uri)
    episodes(db_url, "c", "d", "e")
    second = export(db_url, uri, incremental=True)
    assert second.episodes == 3  # only the new ones
    assert export(db_url, uri, incremental=True).episodes == 0

    rows = listed_rows(fs, base, "calls")
    assert len(rows) == len(set(call_keys(rows)))  # no duplicates...
    assert {r["call_id"] for r in rows} == db_calls(db_url)  # ...and no losses
    # The same rows as a local export of the same database, column for column.
    local = tmp_path / "local"
    export(db_url, local)
    for dataset in ("calls", "trajectories"):
        ours = listed_rows(fs, base, dataset)
        theirs = [r for f in sorted((local / dataset).glob("*.parquet"))
                  for r in pq.read_table(f).to_pylist()]
        assert len(ours) == len(theirs) and _keyed(ours) == _keyed(theirs)
    # Every file in the bucket is listed: nothing stray, and the ledgers are there.
    listed = {n for f in ("files", "ledger") for n in _manifest_names(fs, base, f)}
    assert stored_files(fs, base) == listed | {"_manifest.json"}


def _keyed(rows: list[dict]) -> dict:
    return {(r.get("trajectory_id"), r.get("call_id"), r.get("choice_index")): r for r in rows}


def _manifest_names(fs, base: str, field: str) -> list[str]:
    import msgspec

    with fs.open_input_stream(f"{base}/_manifest.json") as f:
        return [n for run in msgspec.json.decode(f.read())["runs"] for n in run[field]]


def _killed_export(db_url: str, uri: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """An export that dies (os._exit, no cleanup) right before writing its manifest."""
    code = textwrap.dedent(f"""
        import os
        from tracetap.exporters import export, objectstore
        objectstore.StoreDir.commit = lambda self, manifest: os._exit(9)
        export({db_url!r}, {uri!r}, incremental=True)
    """)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the store is what matters
def test_an_export_killed_before_its_manifest_is_invisible_and_rerun_once(
        db_url, s3_env, monkeypatch):
    bucket = s3_env.bucket()
    uri, fs, base = f"s3://{bucket}/data", s3_env.filesystem(), f"{bucket}/data"
    episodes(db_url, "a", "b")
    export(db_url, uri, incremental=True)
    before = stored_files(fs, base)
    manifest = fs.open_input_stream(f"{base}/_manifest.json").read()
    episodes(db_url, "c", "d")

    killed = _killed_export(db_url, uri, {**os.environ, **s3_env.env()})
    assert killed.returncode == 9, killed.stderr
    orphans = stored_files(fs, base) - before
    assert {o.split("/")[0] for o in orphans} == {"calls", "trajectories", "_ledger"}
    assert fs.open_input_stream(f"{base}/_manifest.json").read() == manifest
    assert {r["episode_id"] for r in listed_rows(fs, base, "trajectories")} == {"a", "b"}

    rerun = export(db_url, uri, incremental=True)  # the orphans are young: left alone
    assert (rerun.episodes, rerun.orphans_deleted) == (2, 0)
    assert orphans <= stored_files(fs, base)
    rows = listed_rows(fs, base, "calls")
    assert {r["call_id"] for r in rows} == db_calls(db_url)
    assert len(rows) == len(set(call_keys(rows)))
    trajectories = listed_rows(fs, base, "trajectories")
    assert sorted(r["episode_id"] for r in trajectories if r["split_reason"] is None) == [
        "a", "b", "c", "d"]

    monkeypatch.setattr(objectstore, "ORPHAN_GRACE_SECONDS", 0.0)  # now they are old
    cleaned = export(db_url, uri, incremental=True)
    assert (cleaned.episodes, cleaned.orphans_deleted) == (0, len(orphans))
    assert not orphans & stored_files(fs, base)
    assert call_keys(listed_rows(fs, base, "calls")) == call_keys(rows)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_failed_commit_deletes_the_runs_files_and_changes_nothing(
        db_url, s3_env, monkeypatch):
    bucket = s3_env.bucket()
    uri, fs, base = f"s3://{bucket}/data", s3_env.filesystem(), f"{bucket}/data"
    episodes(db_url, "a")
    export(db_url, uri, incremental=True)
    before = stored_files(fs, base)
    episodes(db_url, "b")

    def refused(self, manifest):
        raise OSError("the store refused the manifest")

    monkeypatch.setattr(objectstore.StoreDir, "commit", refused)
    with pytest.raises(ExportError, match="cannot write to s3://"):
        export(db_url, uri, incremental=True)
    assert stored_files(fs, base) == before
    monkeypatch.undo()
    for name, value in s3_env.env().items():
        monkeypatch.setenv(name, value)
    assert export(db_url, uri, incremental=True).episodes == 1


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_overwrite_on_s3_replaces_the_files(db_url, s3_env):
    bucket = s3_env.bucket()
    uri, fs, base = f"s3://{bucket}/data", s3_env.filesystem(), f"{bucket}/data"
    episodes(db_url, "a", "b")
    first = export(db_url, uri)
    with pytest.raises(ExportError, match="already holds an export"):
        export(db_url, uri)
    second = export(db_url, uri, overwrite=True)
    assert not set(first.files) & stored_files(fs, base)
    assert set(second.files) <= stored_files(fs, base)
    assert len(listed_rows(fs, base, "calls")) == 2 * 3  # each episode: 1 + 2 choices


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_cli_takes_credentials_from_the_environment_and_never_prints_them(
        db_url, s3, tmp_path):
    bucket = s3.bucket()
    episodes(db_url, "a")
    env = {**environ_without_aws(), **s3.env(endpoint=False)}
    cli = [sys.executable, "-m", "tracetap", "export", "--db", db_url, "--no-progress"]
    done = subprocess.run([*cli, "--out", f"s3://{bucket}/data", "--s3-endpoint", s3.endpoint],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"-> s3://{bucket}/data" in done.stdout and SECRET not in done.stdout + done.stderr
    # Credentials in the URI itself are masked wherever the URI is echoed.
    inline = f"s3://{KEY_ID}:{SECRET}@{bucket}/again"
    summary = export(db_url, inline, s3_endpoint=s3.endpoint)
    assert summary.out == f"s3://***@{bucket}/again" and summary.episodes == 1
    missing = subprocess.run([*cli, "--out", inline.replace(bucket, "no-such-bucket-x"),
                              "--s3-endpoint", s3.endpoint], cwd=ROOT,
                             env=environ_without_aws(), capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1, (
        missing.stderr)
    line = missing.stderr.strip()
    assert line.startswith("tracetap export: error: ") and "s3://***@no-such-bucket-x" in line
    assert SECRET not in missing.stdout + missing.stderr


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_an_fsspec_only_filesystem_works_too(db_url):
    episodes(db_url, "a", "b")
    summary = export(db_url, "memory://tracetap-test/data", incremental=True)
    memory = fsspec.filesystem("memory")
    names = {p.split("/data/", 1)[1] for p in memory.find("/tracetap-test/data")}
    assert set(summary.files) | {"_manifest.json"} <= names
    assert export(db_url, "memory://tracetap-test/data", incremental=True).episodes == 0
    memory.rm("/tracetap-test", recursive=True)




@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_refused_write_ends_the_read_ahead_before_the_database_closes(
        db_url, s3_env, monkeypatch):
    """The export reads the next page while it writes the current one. When a write fails,
    that read must end while the database is still open: left to the event loop's
    shutdown, its query can still be on aiosqlite's thread when the loop closes, and the
    thread then prints "Exception in thread" at exit, under the CLI's one-line error."""
    from tracetap.storage.scan import Reader

    order: list[str] = []
    pages, close = Reader.episodes, Reader.__aexit__

    async def watched_pages(self, filt):
        try:
            async for page in pages(self, filt):
                yield page
        finally:
            order.append("pages ended")

    async def watched_close(self, *exc_info):
        order.append("database closed")
        await close(self, *exc_info)

    monkeypatch.setattr(Reader, "episodes", watched_pages)
    monkeypatch.setattr(Reader, "__aexit__", watched_close)
    episodes(db_url, *(f"e{i}" for i in range(12)))
    with pytest.raises(ExportError, match="no-such-bucket-y"):
        export(db_url, "s3://no-such-bucket-y/data", page_size=4)
    assert order == ["pages ended", "database closed"]
