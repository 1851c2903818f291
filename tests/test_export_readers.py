"""The export where training and analysis read it (docs/export.md, "Reading the dataset from
object storage"): an
export on a local S3 (moto's server), with the orphans of a run killed before its
manifest, read by Ray Data (a trainer's data loader), DuckDB (an analyst's query) and
Hugging Face ``datasets``, each given ``exporters.files``: the rows each one reads are
the export's own pyarrow read of the listed files, value for value, token ids included,
and no orphan row.
"""

from __future__ import annotations

import os

import pyarrow as pa
import pytest
from helpers.objectstore import listed_rows, moto_server, stored_files

from tests.test_export_s3 import _killed_export, episodes
from tracetap.exporters import ExportError, export, files
from tracetap.migrations import upgrade

DATASETS = ("calls", "trajectories")
KEYS = {"calls": ("call_id", "choice_index"), "trajectories": ("trajectory_id",)}


class Store:
    """One export on the local S3: two committed runs (a, b; then c, d) and the orphans
    of a third, killed before its manifest (episode e)."""

    def __init__(self, server, bucket: str, db: str):
        self.server, self.db, self.uri = server, db, f"s3://{bucket}/runs/data"
        self.fs, self.base = server.filesystem(), f"{bucket}/runs/data"

    def expected(self, dataset: str) -> list[dict]:
        return sorted_rows(dataset, listed_rows(self.fs, self.base, dataset))


def sorted_rows(dataset: str, rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: tuple(-1 if r[k] is None else r[k]
                                            for k in KEYS[dataset]))


def rows_of(table: pa.Table, dataset: str) -> list[dict]:
    return sorted_rows(dataset, table.to_pylist())


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    db = f"sqlite:///{tmp_path_factory.mktemp('db') / 'tracetap.db'}"
    upgrade(db)
    with moto_server() as server, pytest.MonkeyPatch.context() as env:
        for name, value in server.env().items():  # what every reader below relies on
            env.setenv(name, value)
        store = Store(server, server.bucket(), db)
        episodes(db, "a", "b")
        export(db, store.uri, incremental=True)
        episodes(db, "c", "d")
        export(db, store.uri, incremental=True)
        episodes(db, "e")
        killed = _killed_export(db, store.uri, {**os.environ})
        assert killed.returncode == 9, killed.stderr
        yield store


def test_files_are_the_manifests_and_leave_the_orphans_out(store):
    stored = stored_files(store.fs, store.base)
    for dataset in DATASETS:
        listed = files(store.uri, dataset)
        names = [u.removeprefix(store.uri + "/") for u in listed]
        assert all(u.startswith(f"{store.uri}/{dataset}/part-") for u in listed)
        assert len(names) == 2 and set(names) <= stored  # one per committed run
        orphans = {n for n in stored - set(names) if n.startswith(dataset + "/")}
        assert len(orphans) == 1  # the killed run's: a glob would read it
    assert {r["episode_id"] for r in store.expected("trajectories")} == {"a", "b", "c", "d"}


def test_pyarrow_reads_the_uris_as_they_are(store):
    import pyarrow.parquet as pq

    for dataset in DATASETS:  # pyarrow.dataset.dataset(uris) would want a filesystem
        table = pa.concat_tables(pq.read_table(u) for u in files(store.uri, dataset))
        assert rows_of(table, dataset) == store.expected(dataset)


def test_files_of_a_local_export_are_its_paths(store, tmp_path):
    summary = export(store.db, tmp_path / "local")
    for dataset in DATASETS:
        listed = [str(tmp_path / "local" / f) for f in summary.files
                  if f.startswith(dataset + "/")]
        assert files(tmp_path / "local", dataset) == listed
        assert files(f"file://{tmp_path}/local", dataset) == listed
        assert listed and all(os.path.isfile(f) for f in listed)


def test_files_refuses_what_is_not_an_export(store, tmp_path):
    with pytest.raises(ExportError, match="holds no export"):
        files(store.uri.rsplit("/", 1)[0], "calls")
    with pytest.raises(ExportError, match="no dataset 'rows'"):
        files(store.uri, "rows")
    local = tmp_path / "empty"
    local.mkdir()
    with pytest.raises(ExportError, match="holds no export"):
        files(local, "calls")


@pytest.fixture(scope="module")
def ray_local(store):
    import ray  # imported here: ray takes a while to import, and only these tests use it
    # Workers inherit the driver's environment (the S3 variables) when the node starts.
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield ray
    finally:
        ray.shutdown()


# Ray Data's own modules warn about their own deprecated settings on first use.
@pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")
def test_ray_data_reads_exactly_the_listed_rows(store, ray_local):
    ray = ray_local
    for dataset in DATASETS:
        data = ray.data.read_parquet(files(store.uri, dataset))
        table = pa.concat_tables(ray.get(data.to_arrow_refs()))
        assert rows_of(table, dataset) == store.expected(dataset)
    # The trainer's loop: batches of token ids, each trajectory once.
    data = ray.data.read_parquet(files(store.uri, "trajectories")).select_columns(
        ["trajectory_id", "prompt_ids", "response_ids"])
    seen = [(tid, list(p), list(r)) for batch in data.iter_batches(batch_size=2,
                                                                  batch_format="pyarrow")
            for tid, p, r in zip(*(batch[c].to_pylist() for c in batch.column_names))]
    assert sorted(seen) == sorted((r["trajectory_id"], r["prompt_ids"], r["response_ids"])
                                  for r in store.expected("trajectories"))


def _duckdb_s3(store):
    """DuckDB reads S3 through its httpfs extension, which it downloads on first use (no
    network here); without it, through an fsspec filesystem registered with it: s3fs,
    which reads the same environment."""
    import duckdb
    import s3fs

    con = duckdb.connect()
    con.register_filesystem(s3fs.S3FileSystem())
    return con


def test_duckdb_queries_exactly_the_listed_rows(store):
    con = _duckdb_s3(store)
    try:
        for dataset in DATASETS:
            table = con.sql("SELECT * FROM read_parquet(?)",
                            params=[files(store.uri, dataset)]).to_arrow_table()
            assert rows_of(table, dataset) == store.expected(dataset)
        # The analyst's query: per episode, trajectories, trained tokens, reward.
        query = """SELECT episode_id, count(*) AS n,
                          sum(list_sum(response_mask)) AS trained, max(reward) AS reward
                   FROM read_parquet(?) GROUP BY episode_id ORDER BY episode_id"""
        got = con.execute(query, [files(store.uri, "trajectories")]).fetchall()
        want = {}
        for r in store.expected("trajectories"):
            n, trained, _ = want.get(r["episode_id"], (0, 0, None))
            want[r["episode_id"]] = (n + 1, trained + sum(r["response_mask"]), r["reward"])
        assert got == [(e, *v) for e, v in sorted(want.items())]
        # What the list is for: a glob over the folder also reads the killed run's orphan.
        glob = f"{store.uri}/trajectories/*.parquet"
        globbed = {e for (e,) in con.execute(
            "SELECT DISTINCT episode_id FROM read_parquet(?)", [glob]).fetchall()}
        assert globbed == {"a", "b", "c", "d", "e"} and "e" not in want
    finally:
        con.close()


def test_hf_datasets_loads_exactly_the_listed_rows(store, tmp_path):
    import datasets  # it opens s3:// through fsspec: s3fs, which reads the same environment

    for dataset in DATASETS:
        loaded = datasets.load_dataset("parquet", data_files=files(store.uri, dataset),
                                       split="train", cache_dir=str(tmp_path / "hf"))
        assert rows_of(loaded.with_format("arrow")[:], dataset) == store.expected(dataset)
