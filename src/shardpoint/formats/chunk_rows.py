"""``.chunk_index`` version 2 and ``.chunk_rows``: an index each planner reads only its keys' rows of.

Version 1 of the index (:mod:`~shardpoint.formats.chunk_index`) is one file, read whole
by rank 0, which plans every rank's load: at 16,384 ranks × 300 tensors, 256 MB read,
held and planned on one process. Version 2 splits it in two, so that a load's plan can
be split by key across ranks (:mod:`~shardpoint.formats.split_plan`):

* ``.chunk_index``, the *head*: the outline (keys, dtypes, shapes), each key's range of
  rows, the files, and **each key's XXH3** of its rows; a safetensors file like version
  1 (the same header fields, plus ``width``), without the per-chunk columns. Rank 0
  reads it whole, checked against the marker, and broadcasts it (a few dozen bytes per
  tensor).
* ``.chunk_rows``: the rows, raw little-endian records of :func:`record_dtype` (each
  chunk's box, file, offset and length), in key order, no header. A planner of keys
  ``[k0, k1)`` fetches their rows with **one ranged read** (:meth:`Head.byte_range`),
  and checks **only what it read**, key by key against the head's checksums
  (:func:`read_rows`): the file's whole-file checksum in the marker would need every
  byte. Raw records rather than a second safetensors file: a record's place follows
  from its row alone, so there is no header to fetch first, and a key's rows are one
  contiguous range (columns would be one range per column).

Summed over ranks, a load reads the head once and each key's rows once: the index's
size, as before. The head's checksums bind the rows to it, and the marker binds the
head to the checkpoint, so rows copied from another checkpoint, even of the same size,
are refused by name, naming the key whose bytes differ.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import safetensors.numpy
import xxhash

from shardpoint.catalog.metadata import FileRecord, listed_record
from shardpoint.errors import CorruptCheckpointError
from shardpoint.formats.chunk_table import (
    FIX,
    OUTLINE_COLUMNS,
    ChunkIndex,
    File,
    Outline,
    check_chunks,
    check_metadata_record,
    check_outline,
    check_tensors_fit,
    check_within_files,
    columns,
    complaint,
    file_sizes,
    header,
    index_reads,
    outline_columns,
    read,
)
from shardpoint.formats.dcp_metadata import DCP_METADATA
from shardpoint.formats.safetensors_index import RangeReader
from shardpoint.storage.base import Storage

__all__ = [
    "HEAD_NAME",
    "ROWS_NAME",
    "VERSION",
    "Head",
    "decode_head",
    "encode_split",
    "read_head",
    "read_rows",
    "record_dtype",
    "rows_reader",
    "sized",
]

ROWS_NAME = ".chunk_rows"  # raw records, no header: N rows of record_dtype(width)
HEAD_NAME = ".chunk_index"  # the head: the index's file name in every version
VERSION = "2"
_MAX_WIDTH = 64  # dimensions a record holds at most (torch's own limit on a tensor's dimensions is lower)
_LIMIT = 1 << 62
_HEAD_COLUMNS = {**OUTLINE_COLUMNS, "key_xxh3": (np.uint64, 1)}  # name: (dtype, ndim)


def record_dtype(width: int) -> np.dtype:
    """One row of ``.chunk_rows``: a chunk's box (``width`` dimensions, padded with 0 and 1) and its place."""
    return np.dtype(
        [
            ("starts", "<i8", (width,)),
            ("sizes", "<i8", (width,)),
            ("file", "<i8"),  # index into the head's files; -1: no stored data listed
            ("offset", "<i8"),
            ("length", "<i8"),
        ]
    )


@dataclass
class Head:
    """What ``.chunk_index`` version 2 holds: everything but the rows (see the module docstring)."""

    keys: list[str]
    dtypes: list[str | None]
    shapes: list[tuple[int, ...]]
    first_row: np.ndarray  # int64 (keys + 1,)
    key_xxh3: np.ndarray  # uint64 (keys,): XXH3-64 of each key's records in .chunk_rows
    width: int
    files: list[File]
    file_sizes: np.ndarray | None = None  # int64 (files,): the marker's sizes, once checked (decode_head)

    @property
    def outline(self) -> Outline:
        return Outline(self.keys, self.dtypes, self.shapes)

    def byte_range(self, k0: int, k1: int) -> tuple[int, int]:
        """``(start, length)`` in ``.chunk_rows`` of the rows of keys ``[k0, k1)``."""
        size = record_dtype(self.width).itemsize
        first, last = int(self.first_row[k0]), int(self.first_row[k1])
        return first * size, (last - first) * size


# ----------------------------------------------------------------------------- writing
def encode_split(index: ChunkIndex, metadata: FileRecord) -> tuple[bytes, bytes]:
    """``(.chunk_index, .chunk_rows)`` for ``index``, written beside the ``.metadata`` that ``metadata`` records.

    No Python step per row; one per key, for its checksum.
    """
    width = int(index.starts.shape[1])
    records = np.empty(len(index.file), record_dtype(width))
    records["starts"], records["sizes"] = index.starts, index.sizes
    records["file"], records["offset"], records["length"] = index.file, index.offset, index.length
    rows = records.tobytes()
    arrays, found = outline_columns(index, metadata, VERSION)
    arrays["key_xxh3"] = _key_digests(memoryview(rows), index.first_row * records.dtype.itemsize)
    found["width"] = str(width)
    return safetensors.numpy.save(arrays, metadata=found), rows


def _key_digests(rows: memoryview, bounds: np.ndarray) -> np.ndarray:
    """XXH3-64 of each key's bytes, ``rows[bounds[k]:bounds[k + 1]]``."""
    edges = bounds.tolist()
    digest = xxhash.xxh3_64_intdigest
    return np.fromiter((digest(rows[a:b]) for a, b in itertools.pairwise(edges)), np.uint64, len(edges) - 1)


# ----------------------------------------------------------------------------- reading
def decode_head(data: bytes, name: str, metadata: FileRecord | None, size_of: Callable[[str], int]) -> Head:
    """``data``, the bytes of a version-2 ``.chunk_index``, as a :class:`Head`, every column checked.

    ``name``: the file, for messages; ``metadata``: the marker's record of ``.metadata``;
    ``size_of(file)``: a listed file's size (``.chunk_rows`` and every file the head
    names), raising for one the marker does not list. The columns are views of ``data``.

    Raises:
        CorruptCheckpointError: naming ``name``: not a version-2 index, one of another
        ``.metadata``, a column that contradicts another, or more tensor bytes than the files hold.
    """
    found = header(data, name, (VERSION,))
    check_metadata_record(found, metadata, name)
    bad = complaint(name)
    rows, width = _count(found, "rows", _LIMIT), _count(found, "width", _MAX_WIDTH + 1)
    if rows is None or width is None:
        raise bad("its counts of chunks or dimensions are not numbers in range")
    arrays = columns(data, name, _HEAD_COLUMNS)
    outlined = check_outline(arrays, found, name, rows)
    if not max([1, *map(len, outlined.shapes)]) <= width:
        raise bad("its rows have fewer dimensions than its tensors")
    if len(arrays["key_xxh3"]) != len(outlined.keys):
        raise bad("it has another number of row checksums than of keys")
    expected = rows * record_dtype(width).itemsize
    if size_of(ROWS_NAME) != expected:
        raise bad(f"the marker lists {ROWS_NAME} of {size_of(ROWS_NAME)} bytes, where its {rows} rows are {expected}")
    sizes = file_sizes(outlined.files, size_of)
    check_tensors_fit(outlined.dtypes, outlined.shapes, int(sizes.sum()), bad)
    first_row, key_xxh3 = outlined.first_row, arrays["key_xxh3"]
    return Head(outlined.keys, outlined.dtypes, outlined.shapes, first_row, key_xxh3, width, outlined.files, sizes)


def _count(found: dict[str, Any], field: str, below: int) -> int | None:
    """The header's ``field``, a decimal count below ``below``; None if it is not one."""
    text = found.get(field)
    if not isinstance(text, str) or not text.isascii() or not text.isdigit() or len(text) > 19:
        return None
    value = int(text)
    return value if value < below else None


def read_rows(
    read_range: Callable[[int, int], bytes], head: Head, k0: int, k1: int, name: str, size_of: Callable[[str], int]
) -> ChunkIndex:
    """The rows of keys ``[k0, k1)``, fetched with one ``read_range(start, length)`` and checked, as a ChunkIndex.

    ``name``: ``.chunk_rows`` as messages name it (its path). The result holds keys
    ``[k0, k1)`` only, ``first_row`` counted from their first row, and every file of
    the head (the same numbering). Its columns are views of the bytes read (``file``
    converted to int32 once checked); no Python step per row.

    Raises:
        CorruptCheckpointError: naming ``name``: a short read, a key whose bytes fail the
        head's checksum (naming the key), or a row outside its tensor or its file.
    """
    if not 0 <= k0 <= k1 <= len(head.keys):
        raise ValueError(f"keys [{k0}, {k1}) are not keys of an index of {len(head.keys)}")
    start, length = head.byte_range(k0, k1)
    data = read_range(start, length)
    index_reads.bytes += len(data)
    index_reads.reads += 1
    if len(data) != length:
        raise CorruptCheckpointError(
            f"{name} is damaged: {len(data)} bytes where its head places {length} (from byte {start}), "
            f"the rows of {head.keys[k0]!r} onwards; it is shorter than written. {FIX}"
        )
    first_row = head.first_row[k0 : k1 + 1] - head.first_row[k0]
    _check_digests(memoryview(data), first_row, head, k0, name)
    records = np.frombuffer(data, record_dtype(head.width))
    fields = ("starts", "sizes", "file", "offset", "length")  # views; a copy only on a big-endian machine
    starts, sizes, file, offset, length_ = (records[f].astype(np.int64, copy=False) for f in fields)
    keys, dtypes, shapes = head.keys[k0:k1], head.dtypes[k0:k1], head.shapes[k0:k1]
    index = ChunkIndex(keys, dtypes, shapes, first_row, starts, sizes, file, offset, length_, head.files)
    bad = complaint(name)
    check_chunks(index, np.diff(first_row), bad)  # file ids in range before they become int32
    sizes_of_files = head.file_sizes if head.file_sizes is not None else file_sizes(head.files, size_of)
    check_within_files(index, sizes_of_files, bad)
    index.file = file.astype(np.int32)
    return index


def _check_digests(data: memoryview, first_row: np.ndarray, head: Head, k0: int, name: str) -> None:
    """Each key's bytes against its checksum in the head; the first that differs is named."""
    found = _key_digests(data, first_row * record_dtype(head.width).itemsize)
    wrong = np.flatnonzero(found != head.key_xxh3[k0 : k0 + len(found)])
    if len(wrong):
        key = head.keys[k0 + int(wrong[0])]
        raise CorruptCheckpointError(
            f"{name} is damaged: the rows of {key!r} fail their checksum in {HEAD_NAME} (changed after saving, "
            f"or copied from another checkpoint). {FIX}"
        )


def read_head(reader: Any, listed: dict[str, FileRecord]) -> Head:
    """Rank 0's read of ``.chunk_index`` version 2, checked against the marker (``listed``), as a :class:`Head`.

    ``reader``: a DCP reader (its ``fs`` and ``path``).
    """
    where = str(reader.path)
    record = listed_record(listed, HEAD_NAME, where, "the dist format")
    path = reader.fs.concat_path(reader.path, HEAD_NAME)
    data = read(lambda: reader.fs.create_stream(path, "rb"), record, f"{where}/{HEAD_NAME}")
    return decode_head(data, f"{where}/{HEAD_NAME}", listed.get(DCP_METADATA), sized(listed, where))


def sized(listed: dict[str, FileRecord], where: str) -> Callable[[str], int]:
    """``size_of(file)``: the marker's size of a file the index names, refusing one it does not list."""

    def size_of(file: str) -> int:
        return listed_record(listed, file, where, HEAD_NAME).size

    return size_of


def rows_reader(storage: Storage, directory: str) -> Callable[[int, int], bytes]:
    """``read_range(start, length)`` of the checkpoint's ``.chunk_rows``: one exact range, on any storage.

    Through :class:`~shardpoint.formats.safetensors_index.RangeReader`: on an object store
    a stream would read ahead (a block, or to the end of the object), so every planner
    would fetch the rows of all keys after its own; a ranged GET fetches exactly its keys'
    bytes (summed over ranks: the file once).
    """

    def read_range(start: int, length: int) -> bytes:
        reader = RangeReader(storage, directory)
        try:
            return reader.read_bytes(ROWS_NAME, start, length)
        finally:
            reader.close()

    return read_range
