"""A local S3-compatible server for the object-storage tests: moto's standalone server,
started as a subprocess on a free port (``pip install 'moto[server]'``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from helpers.loop import free_port

KEY_ID, SECRET = "AKIDTRACETAPTEST", "tracetap-test-secret-0b5e"  # moto accepts any


class MotoServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> MotoServer:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1).close()
                return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(10)

    def env(self, endpoint: bool = True) -> dict[str, str]:
        """The standard AWS variables the exporter reads (the endpoint unless told not)."""
        env = {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET,
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}
        if endpoint:
            env["AWS_ENDPOINT_URL"] = self.endpoint
        return env

    def filesystem(self) -> pafs.S3FileSystem:
        return pafs.S3FileSystem(access_key=KEY_ID, secret_key=SECRET, region="us-east-1",
                                 endpoint_override=self.endpoint, allow_bucket_creation=True)

    def bucket(self) -> str:
        name = f"tt-{uuid.uuid4().hex[:12]}"
        self.filesystem().create_dir(name)
        return name


@contextmanager
def moto_server() -> Iterator[MotoServer]:
    server = MotoServer().start()
    try:
        yield server
    finally:
        server.stop()


def listed_rows(fs: pafs.FileSystem, base: str, dataset: str) -> list[dict]:
    """What a reader gets: the rows of the files the manifest lists, and nothing else."""
    import msgspec

    with fs.open_input_stream(f"{base}/_manifest.json") as f:
        manifest = msgspec.json.decode(f.read())
    files = [name for run in manifest["runs"] for name in run["files"]
             if name.startswith(dataset + "/")]
    return [row for name in files
            for row in pq.read_table(f"{base}/{name}", filesystem=fs).to_pylist()]


def stored_files(fs: pafs.FileSystem, base: str) -> set[str]:
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    return {i.path[len(base) + 1:] for i in infos if i.type == pafs.FileType.File}


def environ_without_aws() -> dict[str, str]:
    """No credentials, no endpoint (and no slow probe of a cloud metadata service)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, "AWS_EC2_METADATA_DISABLED": "true"}
