"""Where bytes live: the one small interface every storage backend implements.

The commit protocol (:mod:`shardpoint.lifecycle.commit`) and retention only need a handful of
operations, listed on :class:`Storage`. Local disk implements them with POSIX
guarantees (``os.replace`` is atomic, ``fsync`` makes it durable); an object store
implements the same names with put/list/delete, where "publish a directory" is a
no-op because readers trust only the commit marker.

Nothing another tool wrote is ever replaced: a directory may take the place of an
existing one only when that one holds a shardpoint marker (:data:`OWN_MARKERS`).
:func:`refuse_foreign` is the check; the commit protocol runs it before a save writes
anything, and :meth:`LocalStorage.publish_dir` runs it again at the rename, the one
step that would otherwise delete what it finds.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import BinaryIO, Literal, Protocol

from shardpoint.errors import CheckpointError, StorageError
from shardpoint.storage.object_store import is_object_url

__all__ = [
    "OWN_MARKERS",
    "ForeignDataError",
    "LocalStorage",
    "Storage",
    "as_storage_error",
    "open_storage",
    "refuse_foreign",
]

# The files that say "shardpoint wrote this directory": a committed checkpoint
# (catalog.metadata.MARKER_NAME), a node's part of one (lifecycle.node_local.NODE_MARKER)
# a local-tier copy (tier.marker.LOCAL_MARKER) and a retired checkpoint held for the files
# others refer to (lifecycle.references.HELD_NOTE). Spelled out here because storage sits
# below the layers that define them; tests/test_foreign_dirs.py checks that they agree.
OWN_MARKERS = ("shardpoint.json", "shardpoint-node.json", "shardpoint-local.json", ".shardpoint-referenced")


class ForeignDataError(CheckpointError):
    """A save would replace a file or directory that shardpoint did not write; nothing was changed."""


class Storage(Protocol):
    """Operations on paths (strings) under a checkpoint root.

    All methods may be called by any rank; the Checkpointer calls the mutating ones
    from rank 0 only, except data files, which each rank writes itself.
    """

    @property
    def root(self) -> str: ...

    is_local: bool  # paths are POSIX paths (mmap, flock, os.* work on them)
    supports_rename: bool  # False: data is written in place and only the marker commits it

    def join(self, *parts: str) -> str: ...
    def exists(self, path: str) -> bool: ...
    def is_dir(self, path: str) -> bool: ...
    def listdir(self, path: str) -> list[str]: ...
    def size(self, path: str) -> int: ...
    def read_bytes(self, path: str) -> bytes: ...
    def open_read(self, path: str) -> io.BufferedIOBase:
        """A file to read (``readinto`` included: readers fill preallocated buffers)."""
        ...

    def open_write(self, path: str) -> AbstractContextManager[BinaryIO]:
        """Context manager: a new file that is durable (fsynced / uploaded) when the block exits."""
        ...

    def write_atomic(self, path: str, data: bytes) -> None: ...
    def write_new(self, path: str, data: bytes) -> None:
        """Like :meth:`write_atomic`, but raise ``FileExistsError`` if ``path`` exists (create-only)."""
        ...

    def makedirs(self, path: str) -> None: ...
    def remove(self, path: str) -> None: ...
    def publish_dir(self, tmp: str, final: str) -> None: ...
    def free_bytes(self, path: str) -> int | None: ...


class LocalStorage:
    """A local (or network-mounted POSIX) filesystem."""

    is_local = True
    supports_rename = True

    def __init__(self, root: str | os.PathLike[str]):
        self.root = os.path.abspath(os.fspath(root))

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def read_bytes(self, path: str) -> bytes:
        return Path(path).read_bytes()

    def open_read(self, path: str) -> io.BufferedIOBase:
        return open(path, "rb")

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        with open(path, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())

    def write_atomic(self, path: str, data: bytes) -> None:
        """Write to a temporary name, fsync, ``os.replace``, fsync the directory."""
        tmp = f"{path}.tmp-{os.getpid()}"
        with _storage_errors(path, len(data)):
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(os.path.dirname(path))

    def write_new(self, path: str, data: bytes) -> None:
        """Write to a temporary name, fsync, then ``os.link`` it into place: fails if ``path`` exists."""
        tmp = f"{path}.tmp-{os.getpid()}"
        with _storage_errors(path, len(data)):
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.link(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            fsync_dir(os.path.dirname(path))

    def makedirs(self, path: str) -> None:
        with _storage_errors(path):
            os.makedirs(path, exist_ok=True)

    def remove(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.unlink(path)

    def publish_dir(self, tmp: str, final: str) -> None:
        """Rename a finished directory into place and make the rename durable.

        An existing ``final`` is replaced only when shardpoint wrote it (it holds one of
        :data:`OWN_MARKERS`); anything else raises :class:`ForeignDataError` and stays.
        """
        refuse_foreign(self, final)
        with _storage_errors(final):
            fsync_dir(tmp)
            if os.path.exists(final):
                trash = f"{os.path.dirname(final)}/.shardpoint-trash-{os.path.basename(final)}-{os.getpid()}"
                os.replace(final, trash)
                os.replace(tmp, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.replace(tmp, final)
            fsync_dir(os.path.dirname(final))

    def free_bytes(self, path: str) -> int | None:
        probe = path
        while probe and not os.path.exists(probe):
            probe = os.path.dirname(probe)
        try:
            return shutil.disk_usage(probe or ".").free
        except OSError:
            return None


def open_storage(root: str | os.PathLike[str]) -> Storage:
    """The backend for ``root``: ``s3://``, ``gs://``, ``az://`` (``abfs://``) URLs are object storage,
    other fsspec URLs (``memory://``, ``hdfs://``...) are served alike with a warning, anything else a local path."""
    text = os.fspath(root)
    if is_object_url(text):
        from shardpoint.storage.object_store import ObjectStorage

        return ObjectStorage(text)
    if "://" in text and not text.startswith("file://"):
        from shardpoint.storage.fsspec_store import is_fsspec_url, warn_once

        if is_fsspec_url(text):  # any other fsspec filesystem, served as an object store is (see fsspec_store)
            from shardpoint.storage.object_store import ObjectStorage

            storage = ObjectStorage(text)
            warn_once(text, storage.fs)
            return storage
        raise StorageError(
            f"{text}: unsupported URL scheme (no fsspec filesystem knows it); use a local path, s3://bucket/prefix, "
            "gs://bucket/prefix, az://container/prefix or another fsspec URL"
        )
    return LocalStorage(text.removeprefix("file://"))


def refuse_foreign(storage: Storage, path: str) -> None:
    """Raise unless ``path`` is absent, empty, or a directory shardpoint wrote (it holds a marker).

    Called before anything is written for a save whose target is ``path``, so a refused
    save costs nothing and leaves the tree as it was. An empty directory holds nothing to
    lose (a save that another tool began and abandoned, a ``mkdir`` ahead of time).

    Raises:
        ForeignDataError: naming ``path``, a few of the names it holds, and the fix.
    """
    if not storage.exists(path):
        return
    if not storage.is_dir(path):
        raise ForeignDataError(
            f"{path} exists and is a file, not a checkpoint shardpoint wrote; shardpoint never replaces data it "
            "did not write: move it away, or save under another name or directory"
        )
    names = storage.listdir(path)
    if not names or any(marker in names for marker in OWN_MARKERS):
        return
    shown = ", ".join(names[:5]) + (f", ... ({len(names)} entries)" if len(names) > 5 else "")
    raise ForeignDataError(
        f"{path} exists and was not written by shardpoint (it holds {shown}; no {OWN_MARKERS[0]}); "
        "shardpoint never replaces data it did not write: move or delete it yourself, or save under another "
        "directory or iteration"
    )


def fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _storage_errors:
    """Turn OS errors into StorageError naming the path and the likely fix."""

    def __init__(self, path: str, needed: int | None = None):
        self.path = path
        self.needed = needed

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        if exc is None or not isinstance(exc, OSError):
            return False
        raise StorageError(describe_os_error(exc, self.path, self.needed)) from exc


def as_storage_error(exc: BaseException, path: str, needed: int | None = None) -> StorageError | None:
    """A StorageError for a write that failed because of the storage, else None.

    ``torch.save`` reports a full disk as ``RuntimeError: ... unexpected pos`` rather
    than ENOSPC, so a RuntimeError counts as "disk full" when the disk is nearly full.
    """
    if isinstance(exc, OSError):
        return StorageError(describe_os_error(exc, path, needed))
    if isinstance(exc, RuntimeError):
        free = LocalStorage(path).free_bytes(path)
        if free is not None and free < max(needed or 0, 1 << 20):
            return StorageError(describe_os_error(OSError(errno.ENOSPC, "No space left on device"), path, needed))
    return None


def describe_os_error(exc: OSError, path: str, needed: int | None = None) -> str:
    """One sentence for an OS error during checkpoint I/O: what, where, and the fix."""
    if exc.errno == errno.ENOSPC:
        free = LocalStorage(path).free_bytes(path)
        need = f"; about {needed / 1e9:.2f} GB needed" if needed else ""
        have = f", {free / 1e9:.2f} GB free" if free is not None else ""
        return f"no space left on device writing {path}{need}{have}; free space or save elsewhere"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied writing {path}; fix the directory's permissions or choose another save dir"
    if exc.errno == errno.EROFS:
        return f"{path} is on a read-only filesystem; save to a writable directory"
    return f"{exc.strerror or exc} ({path})"
