"""S3-compatible object storage (AWS S3, MinIO, Ceph, GCS's S3 API) through ``s3fs``.

Why s3fs: it is the fsspec backend, so DCP writes and reads shards through it
directly (``FsspecWriter``/``FsspecReader``: multipart uploads, ranged GETs that fetch
only the bytes a rank needs), and credentials and endpoint come from the standard
AWS environment and config (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ...), nothing new.

An object store cannot rename, so the commit protocol writes data objects in
place under the iteration prefix, then ``shardpoint.json``, then the tracker object;
each PUT is atomic. A prefix without a marker is never loaded and is removed at the
next start. Transient errors are retried with exponential backoff by botocore
(``standard`` mode); what still fails is reported as a :class:`StorageError`.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

from shardpoint.errors import StorageError

__all__ = ["S3Storage", "s3_filesystem", "s3_options"]


WRITE_BLOCK = 16 << 20  # multipart part size: what an upload holds in memory
READ_BLOCK = 64 << 20  # ranged-read size: fewer requests, memory is only transient


def s3_options(block_size: int = WRITE_BLOCK) -> dict[str, Any]:
    """s3fs constructor options: retries, timeouts, no listing caches (other ranks change the store).

    ``SHARDPOINT_S3_TIMEOUT`` (seconds, default 60) bounds each request and
    ``SHARDPOINT_S3_RETRIES`` (default 6) counts attempts, with exponential backoff.
    ``block_size`` is the multipart part size for writers and the read-ahead for readers.
    """
    timeout = float(os.environ.get("SHARDPOINT_S3_TIMEOUT", "60"))
    attempts = int(os.environ.get("SHARDPOINT_S3_RETRIES", "6"))
    return {
        "skip_instance_cache": True,
        "use_listings_cache": False,
        "default_block_size": block_size,
        "config_kwargs": {
            "retries": {"max_attempts": attempts, "mode": "standard"},
            "connect_timeout": min(timeout, 10),
            "read_timeout": timeout,
        },
    }


def s3_filesystem() -> Any:
    """A fresh s3fs filesystem with :func:`s3_options`."""
    try:
        import s3fs
    except ImportError:
        raise StorageError("s3:// paths need the s3fs package: pip install 'shardpoint[s3]'") from None
    fs = s3fs.S3FileSystem(**s3_options())
    fs.retries = s3_options()["config_kwargs"]["retries"]["max_attempts"]  # s3fs's own retry loop, on top of botocore
    return fs


class S3Storage:
    """``s3://bucket/prefix`` as shardpoint storage."""

    is_local = False
    supports_rename = False

    def __init__(self, root: str):
        self.root = root.rstrip("/")
        self.fs = s3_filesystem()
        bucket = self.root.removeprefix("s3://").split("/", 1)[0]
        if not bucket:
            raise StorageError(f"{root}: no bucket in the URL; use s3://bucket/prefix")

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts)

    def exists(self, path: str) -> bool:
        with _errors(path):
            return self.fs.exists(path)

    def is_dir(self, path: str) -> bool:
        with _errors(path):
            return self.fs.isdir(path)

    def listdir(self, path: str) -> list[str]:
        with _errors(path):
            try:
                return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False))
            except FileNotFoundError:
                return []

    def size(self, path: str) -> int:
        with _errors(path):
            return self.fs.size(path)

    def read_bytes(self, path: str) -> bytes:
        with _errors(path):
            return self.fs.cat_file(path)

    def open_read(self, path: str) -> BinaryIO:
        with _errors(path):
            return self.fs.open(path, "rb", block_size=READ_BLOCK)

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        with _errors(path), self.fs.open(path, "wb") as f:
            yield f

    def write_atomic(self, path: str, data: bytes) -> None:
        """One PUT: readers see the old object or the new one, never a mix."""
        with _errors(path):
            self.fs.pipe_file(path, data)

    def makedirs(self, path: str) -> None:
        """Object stores have no directories."""

    def remove(self, path: str) -> None:
        with _errors(path):
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)

    def publish_dir(self, tmp: str, final: str) -> None:
        """Data was written in place (``tmp == final``); the marker alone commits it."""
        if tmp != final:
            raise StorageError(f"cannot rename {tmp} to {final} on object storage")

    def free_bytes(self, path: str) -> int | None:
        return None


class _errors:
    """Turn client errors that survived the retries into one StorageError naming the path."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or isinstance(exc, (FileNotFoundError, StorageError)):
            return False
        if isinstance(exc, (OSError, ConnectionError, TimeoutError)) or type(exc).__module__.startswith(
            ("botocore", "aiobotocore", "aiohttp", "s3fs")
        ):
            raise StorageError(
                f"object storage request for {self.path} failed after retries ({type(exc).__name__}: "
                f"{str(exc)[:200]}); check the endpoint (AWS_ENDPOINT_URL), credentials and bucket"
            ) from exc
        return False
