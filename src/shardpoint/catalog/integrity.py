"""Checksums of data files, and checking a checkpoint against its marker.

Checksums are computed on the bytes as they are written (:class:`HashingWriter`), so
recording them costs no second read of the checkpoint. xxHash's XXH3-64 hashes at
several GB/s per core, far above any disk a checkpoint goes to; CRC32 (zlib) is
3-5x slower on the same data.

The same reasoning turns off the CRC32 that ``torch.save`` computes for every record
of its zip archive while shardpoint writes (:func:`without_zip_crc32`): at about
0.7 GB/s it was the largest CPU cost of a save, ``torch.load`` never checks it, and
the XXH3 of each whole file already detects any changed byte.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

import xxhash

from shardpoint.catalog.metadata import HELD_NOTE, MARKER_NAME, CheckpointMetadata, FileRecord, referred_dir
from shardpoint.storage.base import Storage

_serialization_config: Any  # torch's config module: its settings and ``_config`` are made at run time
try:
    from torch.utils.serialization import config as _serialization_config
except ImportError:  # torch < 2.6 has no such setting: files keep their CRC32
    _serialization_config = None

__all__ = [
    "FileProblem",
    "HashingWriter",
    "RawWriter",
    "checksum_file",
    "record_file",
    "sibling_problem",
    "verify_files",
    "without_zip_crc32",
]

_CHUNK = 16 << 20
_VERIFY_THREADS = max(1, min(4, os.cpu_count() or 1))


def _crc_setting_is_per_thread() -> bool:
    """Whether torch keeps ``compute_crc32`` per thread (recent releases: a ContextVar).

    Older releases keep it process-wide, where turning it off from a writer thread would
    change what every other thread writes (and overlapping writers could leave it off).
    """
    try:
        entry = _serialization_config._config["save.compute_crc32"]
        return isinstance(entry.user_override, ContextVar)
    except (AttributeError, KeyError, TypeError):
        return False


_CRC_PER_THREAD = _crc_setting_is_per_thread()


def crc32_is_per_thread() -> bool:
    """Whether :func:`without_zip_crc32` takes effect (it does nothing on older torch)."""
    return _CRC_PER_THREAD


@contextmanager
def without_zip_crc32() -> Iterator[None]:
    """``torch.save`` skips its per-record CRC32 in this thread while the block runs.

    PyTorch keeps the setting per thread (``torch.utils.serialization.config``), so it
    must be entered on the thread that calls ``torch.save`` (DCP's writer threads
    enter it through the streams they open) and never changes what other threads of
    the training process write. ``torch.load`` reads such files as usual. Where torch
    keeps the setting process-wide, this does nothing.
    """
    if not _CRC_PER_THREAD:  # process-wide setting (older torch): keep the CRC32 rather than race
        yield
        return
    saved = _serialization_config.save.compute_crc32
    _serialization_config.save.compute_crc32 = False
    try:
        yield
    finally:
        _serialization_config.save.compute_crc32 = saved


class RawWriter(Protocol):
    """What :class:`HashingWriter` writes through: a binary file opened for writing, or a sink like one."""

    def write(self, data: Any, /) -> int: ...
    def tell(self) -> int: ...
    def flush(self) -> None: ...
    def fileno(self) -> int: ...


class HashingWriter:
    """A binary file wrapper that hashes every byte written through it.

    It offers what ``torch.save`` and DCP's writer use (write, tell, flush, fileno).
    """

    def __init__(self, raw: RawWriter):
        self.raw = raw
        self.digest = xxhash.xxh3_64()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.digest.update(view)
        self.size += view.nbytes
        return self.raw.write(view)

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        """The raw file's descriptor, flushed first: a caller takes it to ``fsync``, which must see every byte."""
        self.raw.flush()
        return self.raw.fileno()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        """Flush only: whoever opened the underlying file closes it (DCP closes its stream wrappers early)."""
        self.raw.flush()

    def record(self) -> FileRecord:
        return FileRecord(self.size, self.digest.hexdigest())


def checksum_file(storage: Storage, path: str) -> str:
    """XXH3-64 of a file, read into one reused buffer (no allocation per chunk)."""
    digest = xxhash.xxh3_64()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with storage.open_read(path) as f:
        if not hasattr(f, "readinto"):
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
            return digest.hexdigest()
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def record_file(storage: Storage, path: str) -> FileRecord:
    return FileRecord(storage.size(path), checksum_file(storage, path))


@dataclass(frozen=True)
class FileProblem:
    """One damaged file: its name relative to the checkpoint and what is wrong."""

    file: str
    problem: str

    def __str__(self) -> str:
        return f"{self.file}: {self.problem}"


def verify_files(
    storage: Storage,
    directory: str,
    meta: CheckpointMetadata,
    names: list[str] | None = None,
    checksums: bool = True,
    sizes_only: Collection[str] = (),
) -> list[FileProblem]:
    """Problems with the given files (all by default): missing, wrong size, wrong checksum.

    Files are checked on a few threads when that pays: XXH3 releases the GIL, so hashing
    runs on as many cores as there are files to check, and object-store requests overlap.
    A file of another checkpoint (frozen bytes stored once, ``../<sibling>/<file>``) is
    not even asked for its size unless that sibling is a checkpoint of the same run
    (:func:`sibling_problem`): a crafted marker must not learn anything of other files.
    """
    names = names if names is not None else sorted(meta.files)

    def check(name: str) -> FileProblem | None:
        record = meta.files[name]
        outside = sibling_problem(storage, directory, name)
        if outside is not None:
            return outside
        path = storage.join(directory, name)
        if not storage.exists(path):
            return FileProblem(name, "missing")
        size = storage.size(path)
        if size != record.size:
            return FileProblem(name, f"size {size} bytes, expected {record.size} (truncated or overwritten)")
        if checksums and name not in sizes_only and checksum_file(storage, path) != record.xxh3_64:
            return FileProblem(name, "checksum mismatch (the contents changed after saving)")
        return None

    workers = min(_VERIFY_THREADS, len(names)) if _worth_threads(storage, meta, names, checksums, sizes_only) else 1
    if workers <= 1:
        found = [check(name) for name in names]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="shardpoint-verify") as pool:
            found = list(pool.map(check, names))
    return [problem for problem in found if problem is not None]


def sibling_problem(storage: Storage, directory: str, name: str) -> FileProblem | None:
    """Why ``name``, a marker's reference into a checkpoint beside ``directory``, may not be read; None if it may.

    Stored-once references (:mod:`shardpoint.formats.dedup`) name ``../<checkpoint>/<file>``:
    the sibling must be a checkpoint of the same save directory, committed (its marker)
    or retired and held for the files others refer to (:data:`HELD_NOTE`). Anything
    else beside the checkpoint (a user's folder, another tool's files) is not opened.
    """
    sibling = referred_dir(name)
    if sibling is None:
        return None
    for own in (MARKER_NAME, HELD_NOTE):
        if storage.exists(storage.join(directory, "..", sibling, own)):
            return None
    return FileProblem(
        name,
        f"refers to ../{sibling}, which is not a checkpoint beside this one (neither {MARKER_NAME} nor "
        f"{HELD_NOTE}); the marker is damaged or crafted, so the file was not opened",
    )


#: bytes to hash below which a local check runs on the calling thread: starting the pool
#: (about 5 ms) was an eighth of a tiny-state load at 4 ranks, for a few stat calls
_THREAD_MIN_BYTES = 16 << 20


def _worth_threads(
    storage: Storage, meta: CheckpointMetadata, names: list[str], checksums: bool, sizes_only: Collection[str]
) -> bool:
    if not storage.is_local:
        return True  # each existence and size check is a request: overlap them
    hashed = sum(meta.files[n].size for n in names if n not in sizes_only) if checksums else 0
    return hashed >= _THREAD_MIN_BYTES
