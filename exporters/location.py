"""Where an export lives: a local directory, or a prefix on a filesystem pyarrow opens.

``s3://``, ``gs://``, ``hdfs://`` and ``abfs://`` go through ``pyarrow.fs.FileSystem``
(credentials from the standard environment: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``...);
any other scheme through fsspec when it is installed. Credentials are never echoed:
``display`` masks the user part of a URI and any secret-looking query parameter.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import msgspec
import pyarrow.fs as pafs

from tracetap.exporters.parquet import ExportError

_SECRET_PARAM = re.compile(r"secret|key|token|password|credential|signature", re.I)


class Location(msgspec.Struct, frozen=True):
    filesystem: pafs.FileSystem
    base: str  # the export's root inside ``filesystem``
    display: str  # for messages: credentials masked
    local: Path | None = None  # set for a local directory (atomic rename, a lock file)

    def path(self, name: str) -> str:
        return f"{self.base}/{name}"


def is_remote(out: str | os.PathLike) -> bool:
    scheme = urlsplit(os.fspath(out)).scheme
    return len(scheme) > 1 and scheme != "file"  # one letter: a Windows drive


def resolve(out: str | os.PathLike, s3_endpoint: str | None = None) -> Location:
    """The export root ``out`` names; ``s3_endpoint`` points s3:// at an S3-compatible
    server (like ``AWS_ENDPOINT_URL``, which pyarrow reads itself)."""
    text = os.fspath(out)
    if not is_remote(text):
        root = Path(text[len("file://"):] if text.startswith("file://") else text)
        return Location(pafs.LocalFileSystem(), root.absolute().as_posix(), text, local=root)
    display = masked(text)
    parts = urlsplit(text)
    if s3_endpoint and parts.scheme == "s3":
        endpoint = urlsplit(s3_endpoint if "://" in s3_endpoint else f"https://{s3_endpoint}")
        query = [*parse_qsl(parts.query),
                 ("endpoint_override", endpoint.netloc), ("scheme", endpoint.scheme)]
        text = urlunsplit(parts._replace(query=urlencode(query)))
    try:
        filesystem, base = pafs.FileSystem.from_uri(text)
    except ValueError as exc:  # pyarrow.ArrowInvalid
        if "nrecognized filesystem" not in str(exc):
            raise ExportError(f"cannot open {display}: {exc}") from exc
        filesystem, base = _fsspec(parts.scheme, text, display, exc)
    except OSError as exc:
        raise ExportError(f"cannot open {display}: {exc}") from exc
    return Location(filesystem, base.rstrip("/"), display)


def masked(uri: str) -> str:
    """``uri`` without credentials: user info and secret-looking query values masked."""
    parts = urlsplit(uri)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = urlencode([(k, "***" if _SECRET_PARAM.search(k) else v)
                       for k, v in parse_qsl(parts.query)], safe="*")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def _fsspec(scheme: str, uri: str, display: str, error: Exception) -> tuple[pafs.FileSystem, str]:
    try:
        import fsspec
    except ImportError:
        raise ExportError(f"cannot open {display}: pyarrow does not know {scheme}:// "
                          f"({error}); install fsspec and its {scheme} driver") from error
    try:
        filesystem, path = fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError, OSError) as exc:
        raise ExportError(f"cannot open {display}: {exc}") from exc
    return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem)), path
