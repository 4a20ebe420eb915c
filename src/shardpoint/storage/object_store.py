"""Object storage (S3, Google Cloud Storage, Azure Blob) as shardpoint storage, through fsspec.

Why fsspec for all three: DCP writes and reads shards through an fsspec filesystem
directly (``FsspecWriter``/``FsspecReader``: multipart or resumable uploads, ranged reads
that fetch only the bytes a rank needs), and each cloud's fsspec backend (``s3fs``,
``gcsfs``, ``adlfs``) takes credentials from that cloud's usual sources. What differs by
cloud (the client, its options, its error classes) lives in one small module per store:
:mod:`~shardpoint.storage.s3`, :mod:`~shardpoint.storage.gcs`, :mod:`~shardpoint.storage.azure`.

An object store cannot rename, so the commit protocol writes data objects in place
under the iteration prefix, then ``shardpoint.json`` with a create-only precondition
(S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``, Azure ``If-None-Match: *``: two
writers of one prefix cannot both commit), then the tracker; each PUT is atomic. A
prefix without a marker is never loaded and is removed at the next start.

Requests that fail with a transient error (a connection reset, a timeout, throttling,
a 5xx) are retried here with exponential backoff, bounded by ``SHARDPOINT_OBJECT_RETRIES``
(default 4 attempts), each retry logged; the clients' own retries run inside each attempt.
What still fails is a :class:`StorageError` naming the path and the store's settings.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import posixpath
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, BinaryIO, Literal, TypeVar

from shardpoint.errors import StorageError

__all__ = [
    "OBJECT_SCHEMES",
    "READ_BLOCK",
    "WRITE_BLOCK",
    "ObjectStorage",
    "error_module_is",
    "is_object_url",
    "object_filesystem",
    "retrying",
    "store_of",
    "transient_default",
]

log = logging.getLogger(__name__)

WRITE_BLOCK = 16 << 20  # multipart part size: what an upload holds in memory
READ_BLOCK = 64 << 20  # ranged-read size: fewer requests, memory is only transient

# URL scheme -> the module (under shardpoint.storage) that makes its filesystem
OBJECT_SCHEMES = {"s3": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}

T = TypeVar("T")


def is_object_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a URL of an object store shardpoint serves (``s3://``, ``gs://``, ``az://``...)."""
    text = os.fspath(path)
    return text.split("://", 1)[0].lower() in OBJECT_SCHEMES if "://" in text else False


def store_of(url: str) -> Any:
    """The store module for ``url``'s scheme (``shardpoint.storage.s3``, ``.gcs`` or ``.azure``).

    Any other fsspec scheme: a :class:`~shardpoint.storage.fsspec_store.FsspecStore` for ``url``.
    """
    import importlib

    scheme = url.split("://", 1)[0].lower()
    if scheme not in OBJECT_SCHEMES:
        return importlib.import_module("shardpoint.storage.fsspec_store").FsspecStore(url)
    return importlib.import_module(f"shardpoint.storage.{OBJECT_SCHEMES[scheme]}")


def object_filesystem(url: str, block_size: int = WRITE_BLOCK) -> Any:
    """A fresh fsspec filesystem for ``url``'s store, with shardpoint's client settings.

    ``block_size`` is the multipart part size for writers and the read-ahead for readers.
    Listing caches are off everywhere: other ranks change the store.
    """
    return store_of(url).filesystem(block_size)


def retrying(call: Callable[[], T], what: str, transient: Callable[[BaseException], bool]) -> T:
    """Run ``call``, retrying transient failures with exponential backoff (each retry logged)."""
    attempts = max(1, int(os.environ.get("SHARDPOINT_OBJECT_RETRIES", "4")))
    delay = float(os.environ.get("SHARDPOINT_OBJECT_BACKOFF", "0.5"))
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except Exception as exc:
            if attempt == attempts or not transient(exc):
                raise
            log.warning(
                "%s failed (%s: %s); retry %d of %d in %.1f s",
                what,
                type(exc).__name__,
                str(exc)[:160],
                attempt,
                attempts - 1,
                delay,
            )
            time.sleep(delay)
            delay = min(delay * 2, 30.0)
    raise AssertionError("unreachable")  # pragma: no cover


class ObjectStorage:
    """``s3://``, ``gs://`` or ``az://`` (``abfs://``) ``bucket/prefix`` as shardpoint storage."""

    is_local = False
    supports_rename = False

    def __init__(self, root: str):
        self.root = root.rstrip("/")
        self.scheme, _, rest = self.root.partition("://")
        self.bucket = rest.split("/", 1)[0]
        if not self.bucket:
            raise StorageError(f"{root}: no bucket or container in the URL; use {self.scheme}://bucket/prefix")
        self.store = store_of(self.root)
        self.fs = self.store.filesystem(WRITE_BLOCK)

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts)

    def exists(self, path: str) -> bool:
        return self._call(path, lambda: self.fs.exists(path))

    def is_dir(self, path: str) -> bool:
        return self._call(path, lambda: self.fs.isdir(path))

    def listdir(self, path: str) -> list[str]:
        def names() -> list[str]:
            try:
                return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False))
            except FileNotFoundError:
                return []

        return self._call(path, names)

    def size(self, path: str) -> int:
        return self._call(path, lambda: self.fs.size(path))

    def read_bytes(self, path: str) -> bytes:
        return self._call(path, lambda: self.fs.cat_file(path))

    def open_read(self, path: str) -> io.BufferedIOBase:
        return self._call(path, lambda: self.fs.open(path, "rb", block_size=READ_BLOCK))

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        """An upload that is complete (every part confirmed) when the block exits; retried by the client only."""
        with self._errors(path, writing=True), self.fs.open(path, "wb") as f:
            yield f

    def write_atomic(self, path: str, data: bytes) -> None:
        """One PUT: readers see the old object or the new one, never a mix."""
        self._call(path, lambda: self.fs.pipe_file(path, data), writing=True)

    def write_new(self, path: str, data: bytes) -> None:
        """One PUT that only succeeds if no object is at ``path`` (the store's create-only precondition).

        Raises:
            FileExistsError: another writer created ``path`` first.
        """
        self._call(path, lambda: self.fs.pipe_file(path, data, mode="create"), writing=True)

    def makedirs(self, path: str) -> None:
        """Object stores have no directories."""

    def copy(self, source: str, target: str) -> None:
        """Copy the object ``source`` to ``target`` inside the store (server-side: no bytes pass through here)."""
        self._call(target, lambda: self.fs.copy(source, target), writing=True)

    def copy_many(self, pairs: list[tuple[str, str]], threads: int = 16) -> None:
        """:meth:`copy` each ``(source, target)``, several at once (one request each; the store does the work)."""
        if not pairs:
            return
        with ThreadPoolExecutor(max_workers=min(threads, len(pairs)), thread_name_prefix="shardpoint-copy") as pool:
            list(pool.map(lambda pair: self.copy(*pair), pairs))

    def remove(self, path: str) -> None:
        def rm() -> None:
            if self.fs.exists(path):
                try:
                    self.fs.rm(path, recursive=True)
                except FileNotFoundError:  # gone meanwhile (a retried delete)
                    pass

        self._call(path, rm)

    def publish_dir(self, tmp: str, final: str) -> None:
        """Data was written in place (``tmp == final``); the marker alone commits it."""
        if tmp != final:
            raise StorageError(f"cannot rename {tmp} to {final} on object storage")

    def free_bytes(self, path: str) -> int | None:
        return None

    def _call(self, path: str, call: Callable[[], T], writing: bool = False) -> T:
        with self._errors(path, writing):
            return retrying(call, f"{self.scheme} request for {path}", self.store.is_transient)

    def _errors(self, path: str, writing: bool = False) -> _Errors:
        return _Errors(path, self, writing)


class _Errors:
    """Turn client errors that survived the retries into one StorageError naming the path and the fix."""

    def __init__(self, path: str, storage: ObjectStorage, writing: bool):
        self.path = path
        self.storage = storage
        self.writing = writing

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> Literal[False]:
        store, where = self.storage.store, f"{self.storage.scheme}://{self.storage.bucket}"
        if self.writing and isinstance(exc, FileNotFoundError):  # a write finds no object: no bucket
            raise StorageError(
                f"writing {self.path} failed: the bucket or container {where} does not exist (or this account "
                f"cannot see it); create it, or fix the URL; {store.SETTINGS_HINT}"
            ) from exc
        if exc is None or isinstance(exc, (FileNotFoundError, FileExistsError, StorageError)):
            return False
        if isinstance(exc, (OSError, ConnectionError, TimeoutError)) or store.is_client_error(exc):
            raise StorageError(
                f"{self.storage.scheme}:// request for {self.path} failed after retries (bucket/container "
                f"{self.storage.bucket!r}; {type(exc).__name__}: {str(exc)[:200]}); {store.SETTINGS_HINT}"
            ) from exc
        return False


def error_module_is(exc: BaseException, prefixes: tuple[str, ...]) -> bool:
    """Whether ``exc`` (or what it wraps) comes from one of the client packages ``prefixes``."""
    return any(type(e).__module__.startswith(prefixes) for e in _chain(exc))


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and up to three exceptions it wraps (``__cause__``, else ``__context__``)."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and len(chain) < 4:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


_TRANSIENT_ERRNOS = {errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE, errno.ETIMEDOUT}


def transient_default(exc: BaseException) -> bool:
    """What every store retries: a dropped or refused connection and a timeout, wherever it is wrapped."""
    return any(_transient(e) for e in _chain(exc))


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError)) or getattr(exc, "errno", None) in _TRANSIENT_ERRNOS:
        return True
    return type(exc).__name__ in (
        "ClientConnectionError",
        "ClientOSError",
        "ServerDisconnectedError",
        "ServiceRequestError",
        "ServiceResponseError",
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ServerTimeoutError",
    )
