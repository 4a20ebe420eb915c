"""``.chunk_index`` version 2 and ``.chunk_rows``: an index each planner reads only its share of.

Version 1 of the index (:mod:`~shardpoint.formats.chunk_index`) is one file, read whole
by rank 0, which plans every rank's load: at 16,384 ranks × 300 tensors, 256 MB read,
held and planned on one process. Version 2 splits it in two, so that a load's plan can
be split across ranks by rows (:mod:`~shardpoint.formats.split_plan`):

* ``.chunk_index``, the *head*: the outline (keys, dtypes, shapes), each key's range of
  rows, the files, each key's *slabs* (below), and a random *nonce*; a safetensors file
  like version 1 (the same header fields, plus ``width``, ``block_rows``, ``nonce``),
  without the per-chunk columns. Rank 0 reads it whole, checked against the marker, and
  broadcasts it (a few dozen bytes per tensor).
* ``.chunk_rows``: the rows, raw little-endian records of :func:`record_dtype` (each
  chunk's box, file, offset and length), in key order and within a key sorted by their
  starts, no header. Each key's rows are cut into *blocks* of :data:`BLOCK_ROWS`, each
  followed by its XXH3-64, seeded by the nonce and the block's number. A planner of
  rows ``[r0, r1)`` (block boundaries) fetches them with **one ranged read**
  (:meth:`Head.span`) and checks **only what it read**, block by block
  (:func:`read_span`): the marker's whole-file checksum would need every byte, and a
  checksum per key in the head could not check part of a key. Checksums in the file,
  not in the head, so the head every rank holds stays a few dozen bytes per tensor.

A key's *slabs* let a rank find which rows a box of it can overlap without reading
them, so one tensor's rows (one per saving rank) can be planned by many planners: the
rows of a key whose chunks each lie in one slab of ``slab_step`` elements along
``split_dim``, ``slab_rows`` rows per slab (an even ``Shard(0)``; a TP × FSDP grid),
are the rows ``[i * slab_rows, (i + 1) * slab_rows)`` of the key for slab ``i``. A key
saved another way has ``slab_step`` 0 and is planned whole by one planner. Every
planner checks the rows it reads against their key's slabs (:func:`read_span`), so a
head that claims slabs its rows do not keep is refused, not trusted.

Summed over ranks, a load reads the head once and each block once: the index's size,
as before. The marker binds the head to the checkpoint and the nonce binds the rows to
the head, so rows copied from another checkpoint, even of the same size, are refused by
name, naming the key whose block differs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import safetensors.numpy
import xxhash

from shardpoint.catalog.metadata import FileRecord, listed_record
from shardpoint.errors import CorruptCheckpointError
from shardpoint.formats import file_runs
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
    padded,
    read,
)
from shardpoint.formats.dcp_metadata import DCP_METADATA
from shardpoint.formats.file_runs import FileRuns
from shardpoint.formats.read_plan import distinct
from shardpoint.formats.safetensors_index import RangeReader
from shardpoint.storage.base import Storage

__all__ = [
    "BLOCK_ROWS",
    "HEAD_NAME",
    "ROWS_NAME",
    "VERSION",
    "Head",
    "decode_head",
    "encode_split",
    "read_head",
    "read_rows",
    "read_span",
    "record_dtype",
    "rows_reader",
    "sized",
]

ROWS_NAME = ".chunk_rows"  # raw records in blocks, each followed by its XXH3-64; no header
HEAD_NAME = ".chunk_index"  # the head: the index's file name in every version
VERSION = "2"
#: rows per checked block: a planner's share is cut at block boundaries, so this is what a share may exceed by
BLOCK_ROWS = 64
_DIGEST = 8  # bytes of each block's XXH3-64, little-endian
_MAX_WIDTH = 64  # dimensions a record holds at most (torch's own limit on a tensor's dimensions is lower)
_MAX_BLOCK = 1 << 20
_LIMIT = 1 << 62
_MAX_ROWS = 1 << 40  # rows × ranks stays within int64 when planners share them out (row_shares)
_MASK = (1 << 64) - 1
_HEAD_COLUMNS = {
    **OUTLINE_COLUMNS,
    **file_runs.RUN_COLUMNS,
    "split_dim": (np.int64, 1),
    "slab_step": (np.int64, 1),  # 0: the key's rows keep no slabs; one planner plans them all
    "slab_rows": (np.int64, 1),
}  # name: (dtype, ndim)


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
    width: int
    files: Sequence[File]  # formats.file_runs.FileRuns once read: names built when asked for
    nonce: int  # seeds each block's checksum (with the block's number)
    split_dim: np.ndarray  # int64 (keys,): the dimension a key's slabs cut
    slab_step: np.ndarray  # int64 (keys,): elements per slab along it; 0: no slabs
    slab_rows: np.ndarray  # int64 (keys,): rows per slab
    block_rows: int = BLOCK_ROWS
    total_bytes: int | None = None  # every file's bytes, as the marker lists them (decode_head)
    block_base: np.ndarray = field(init=False)  # int64 (keys + 1,): blocks before each key

    def __post_init__(self) -> None:
        blocks = -(-np.diff(self.first_row) // self.block_rows)
        self.block_base = np.concatenate(([0], np.cumsum(blocks))).astype(np.int64)

    @property
    def outline(self) -> Outline:
        return Outline(self.keys, self.dtypes, self.shapes)

    def at(self, row: int) -> int:
        """Where in ``.chunk_rows`` row ``row`` begins: a block's first row, a key's, or the end."""
        key = int(np.searchsorted(self.first_row, row, side="right")) - 1
        blocks = int(self.block_base[key]) + -(-(row - int(self.first_row[key])) // self.block_rows)
        return row * record_dtype(self.width).itemsize + blocks * _DIGEST

    def span(self, r0: int, r1: int) -> tuple[int, int]:
        """``(start, length)`` in ``.chunk_rows`` of rows ``[r0, r1)`` (block boundaries, or keys' ends)."""
        start = self.at(r0)
        return start, self.at(r1) - start

    def size(self) -> int:
        """The bytes of ``.chunk_rows``."""
        return int(self.first_row[-1]) * record_dtype(self.width).itemsize + int(self.block_base[-1]) * _DIGEST


# ----------------------------------------------------------------------------- writing
def encode_split(
    index: ChunkIndex, metadata: FileRecord, nonce: int | None = None, block_rows: int = BLOCK_ROWS
) -> tuple[bytes, bytes]:
    """``(.chunk_index, .chunk_rows)`` for ``index``, written beside the ``.metadata`` that ``metadata`` records.

    Each key's rows are sorted by their starts first (:meth:`ChunkIndex.in_order`).
    ``nonce``: the checksums' seed, random unless given; ``block_rows``: rows per checked
    block (tests make it small, to split small keys). No Python step per row; one per block.
    """
    index = index.in_order()
    nonce = int.from_bytes(os.urandom(8), "little") if nonce is None else nonce & _MASK
    width = int(index.starts.shape[1])
    records = np.empty(len(index.file), record_dtype(width))
    records["starts"], records["sizes"] = index.starts, index.sizes
    records["file"], records["offset"], records["length"] = index.file, index.offset, index.length
    arrays, found = outline_columns(index, metadata, VERSION, files=False)
    runs, named, renumbered = file_runs.encode(index.files)
    if len(renumbered):  # numbers outside the files stay as they are (tests craft them)
        known = (index.file >= 0) & (index.file < len(renumbered))
        records["file"] = np.where(known, renumbered[np.clip(index.file, 0, len(renumbered) - 1)], index.file)
    arrays.update(runs)
    found.update(named)
    arrays["split_dim"], arrays["slab_step"], arrays["slab_rows"] = _slabs(index)
    found.update(width=str(width), block_rows=str(block_rows), nonce=str(nonce))
    head = safetensors.numpy.save(arrays, metadata=found)
    first, count = _blocks(index.first_row, 0, int(index.first_row[-1]), block_rows)
    size, data = records.dtype.itemsize, memoryview(records.tobytes())
    digest, out = xxhash.xxh3_64_intdigest, list[bytes | memoryview]()
    for number, (row, rows) in enumerate(zip(first.tolist(), count.tolist())):
        block = data[row * size : (row + rows) * size]
        out += [block, digest(block, (nonce + number) & _MASK).to_bytes(_DIGEST, "little")]
    return head, b"".join(out)


def _slabs(index: ChunkIndex) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each key's ``split_dim``, ``slab_step``, ``slab_rows`` (step 0: its rows keep no slabs), from sorted rows.

    The dimension is the first whose starts differ within the key; the step, the first
    row's size along it; a slab's rows, those starting inside the first slab. The key
    keeps the slabs when every row lies inside slab ``row // slab_rows``.
    """
    keys, counts = len(index.keys), np.diff(index.first_row)
    dim, step, per = (np.zeros(keys, np.int64) for _ in range(3))
    many = np.flatnonzero(counts > 1)
    if not len(many):
        return dim, step, per
    first, last = index.first_row[many], index.first_row[many + 1] - 1
    differs = index.starts[first] != index.starts[last]
    found = differs.any(axis=1)
    many, first, differs = many[found], first[found], differs[found]
    dim[many] = np.argmax(differs, axis=1)
    step[many] = index.sizes[first, dim[many]]
    row_key = np.repeat(np.arange(keys), counts)
    along = index.starts[np.arange(len(row_key)), dim[row_key]]
    per[:] = np.bincount(row_key, along < step[row_key], keys).astype(np.int64)
    keeps = _keeps(index.first_row, dim, step, per, index.starts, index.sizes, 0, len(row_key))
    ndim = np.fromiter(map(len, index.shapes), np.int64, keys)
    keeps &= _slabs_fit(index.shapes, ndim, index.starts.shape[1], counts, dim, step, per)
    step[~keeps] = 0
    return dim, step, np.where(step > 0, per, 0)


def _keeps(
    first_row: np.ndarray,
    dim: np.ndarray,
    step: np.ndarray,
    per: np.ndarray,
    starts: np.ndarray,
    sizes: np.ndarray,
    r0: int,
    r1: int,
) -> np.ndarray:
    """Per key: whether its rows among ``[r0, r1)`` (``starts``, ``sizes``) each lie inside their slab."""
    keys = len(first_row) - 1
    row = np.arange(r0, r1)
    key = np.searchsorted(first_row, row, side="right") - 1
    d, s, p = dim[key], step[key], np.maximum(per[key], 1)
    lo = (row - first_row[key]) // p * s
    at = np.arange(len(row))
    inside = (s > 0) & (per[key] > 0) & (starts[at, d] >= lo) & (starts[at, d] + sizes[at, d] <= lo + s)
    return np.bincount(key, ~inside, keys) == 0


def _blocks(first_row: np.ndarray, r0: int, r1: int, block_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The first row and rows of each block among rows ``[r0, r1)`` (block boundaries), in order."""
    starts = np.maximum(first_row[:-1], r0)
    ends = np.minimum(first_row[1:], r1)
    base = first_row[:-1]
    lo = starts - base  # a block boundary: (r0 - base) is a multiple of block_rows inside its key
    count = np.where(ends > starts, -(-(ends - base) // block_rows) - lo // block_rows, 0)
    key = np.repeat(np.arange(len(count)), count)
    within = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    first = base[key] + (lo[key] // block_rows + within) * block_rows
    return first, np.minimum(first + block_rows, ends[key]) - first


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
    rows, width = _count(found, "rows", _MAX_ROWS), _count(found, "width", _MAX_WIDTH + 1)
    block_rows, nonce = _count(found, "block_rows", _MAX_BLOCK + 1), _count(found, "nonce", 1 << 64)
    if rows is None or width is None or not block_rows or nonce is None:
        raise bad("its counts of chunks, dimensions or rows per block are not numbers in range")
    arrays = columns(data, name, _HEAD_COLUMNS)
    outlined = check_outline(arrays, found, name, rows, file_runs.decode(arrays, found, name))
    ndim = np.fromiter(map(len, outlined.shapes), np.int64, len(outlined.shapes))
    if not max([1, *ndim.tolist()]) <= width:
        raise bad("its rows have fewer dimensions than its tensors")
    dim, step, per = arrays["split_dim"], arrays["slab_step"], arrays["slab_rows"]
    if not len(dim) == len(step) == len(per) == len(outlined.keys):
        raise bad("it has another number of slabs than of keys")
    _check_slabs(outlined.shapes, ndim, np.diff(outlined.first_row), dim, step, per, width, bad)
    outline = (outlined.keys, outlined.dtypes, outlined.shapes, outlined.first_row, width, outlined.files)
    head = Head(*outline, nonce, dim, step, per, block_rows)
    if size_of(ROWS_NAME) != head.size():
        raise bad(
            f"the marker lists {ROWS_NAME} of {size_of(ROWS_NAME)} bytes, where its {rows} rows are {head.size()}"
        )
    head.total_bytes = sum(size_of(path) for path, _ in outlined.files)  # each listed; none kept
    check_tensors_fit(outlined.dtypes, outlined.shapes, head.total_bytes, bad)
    return head


def _check_slabs(
    shapes: Sequence[tuple[int, ...]],
    ndim: np.ndarray,
    rows: np.ndarray,
    dim: np.ndarray,
    step: np.ndarray,
    per: np.ndarray,
    width: int,
    bad: Callable[[str], Exception],
) -> None:
    """Each key's slabs within its tensor and its rows, before any rank routes a box by them.

    A rank places its boxes by these numbers before any planner reads a row, so a
    dimension past the tensor's, or slabs more or larger than its rows could hold, are
    refused here rather than indexing past an array or overflowing int64 later.
    """
    if (dim < 0).any() or (dim >= np.maximum(ndim, 1)).any():
        raise bad("a key's slabs cut a dimension its tensor does not have")
    if (step < 0).any() or ((step != 0) & ~_slabs_fit(shapes, ndim, width, rows, dim, step, per)).any():
        raise bad("a key's slabs are negative, or more or larger than its tensor and its rows hold")


def _slabs_fit(
    shapes: Sequence[tuple[int, ...]],
    ndim: np.ndarray,
    width: int,
    rows: np.ndarray,
    dim: np.ndarray,
    step: np.ndarray,
    per: np.ndarray,
) -> np.ndarray:
    """Per key: slabs no longer than the tensor along ``dim``, no more of them than rows, each with 1 to all rows.

    The writer keeps only slabs that fit (:func:`_slabs`) and the reader refuses others
    (:func:`_check_slabs`), so a box's slab number times its rows stays within the key's rows.
    """
    along = padded(shapes, ndim, width, 1)[np.arange(len(dim)), dim]
    slabs = -(-along // np.maximum(step, 1))
    return (step > 0) & (per >= 1) & (per <= rows) & (step <= along) & (slabs <= rows)


def _count(found: dict[str, Any], field: str, below: int) -> int | None:
    """The header's ``field``, a decimal count below ``below``; None if it is not one."""
    text = found.get(field)
    if not isinstance(text, str) or not text.isascii() or not text.isdigit() or len(text) > 20:
        return None
    value = int(text)
    return value if value < below else None


def read_rows(
    read_range: Callable[[int, int], bytes], head: Head, k0: int, k1: int, name: str, size_of: Callable[[str], int]
) -> ChunkIndex:
    """The rows of keys ``[k0, k1)``, whole: :func:`read_span` of their rows."""
    if not 0 <= k0 <= k1 <= len(head.keys):
        raise ValueError(f"keys [{k0}, {k1}) are not keys of an index of {len(head.keys)}")
    return read_span(read_range, head, k0, k1, int(head.first_row[k0]), int(head.first_row[k1]), name, size_of)


def read_span(
    read_range: Callable[[int, int], bytes],
    head: Head,
    k0: int,
    k1: int,
    r0: int,
    r1: int,
    name: str,
    size_of: Callable[[str], int],
) -> ChunkIndex:
    """Keys ``[k0, k1)`` with their rows among ``[r0, r1)``, fetched with one ``read_range`` and checked.

    ``r0`` and ``r1`` are block boundaries (or a key's ends) within keys ``[k0, k1)``'s
    rows; ``name``: ``.chunk_rows`` as messages name it (its path). The result's
    ``first_row`` counts from ``r0``; its files are the head's its rows use, in the
    head's order. No Python step per row; one per block.

    Raises:
        CorruptCheckpointError: naming ``name``: a short read, a block that fails its
        checksum (naming its key), a row outside its tensor, its file or its key's slabs.
    """
    lo, hi = head.first_row[k0], head.first_row[k1]
    if not (0 <= k0 <= k1 <= len(head.keys) and lo <= r0 <= r1 <= hi):
        raise ValueError(f"rows [{r0}, {r1}) are not rows of keys [{k0}, {k1})")
    start, length = head.span(r0, r1)
    if start + length > size_of(ROWS_NAME):  # decode_head matched the two; a head built otherwise may not
        raise complaint(name)(f"its head places rows up to byte {start + length}, past the file's listed size")
    data = read_range(start, length) if length else b""
    index_reads.bytes += len(data)
    index_reads.reads += 1 if length else 0
    first_row = np.clip(head.first_row[k0 : k1 + 1], r0, r1) - r0
    if len(data) != length:
        key = head.keys[k0 + int(np.searchsorted(first_row[1:], 0, side="right"))]
        raise CorruptCheckpointError(
            f"{name} is damaged: {len(data)} bytes where its head places {length} (from byte {start}), "
            f"the rows of {key!r} onwards; it is shorter than written. {FIX}"
        )
    records = np.frombuffer(_checked(memoryview(data), head, r0, r1, name), record_dtype(head.width))
    fields = ("starts", "sizes", "file", "offset", "length")  # views; a copy only on a big-endian machine
    starts, sizes, file, offset, length_ = (records[f].astype(np.int64, copy=False) for f in fields)
    keys, dtypes, shapes = head.keys[k0:k1], head.dtypes[k0:k1], head.shapes[k0:k1]
    index = ChunkIndex(keys, dtypes, shapes, first_row, starts, sizes, file, offset, length_, head.files)
    bad = complaint(name)
    check_chunks(index, np.diff(first_row), bad)  # file ids in range before they become int32
    used = distinct(np.sort(file[file >= 0]))  # only these files: a share of rows at 16,384 ranks names a few hundred
    index.files = head.files.take(used) if isinstance(head.files, FileRuns) else [head.files[i] for i in used.tolist()]
    file = np.where(file >= 0, np.searchsorted(used, file), -1)
    index.file = file
    total = head.total_bytes if head.total_bytes is not None else sum(size_of(path) for path, _ in head.files)
    check_within_files(index, file_sizes(index.files, size_of), bad, total=total)
    slabs = (head.split_dim[k0:k1], head.slab_step[k0:k1], head.slab_rows[k0:k1])
    kept = _keeps(head.first_row[k0 : k1 + 1] - r0, *slabs, starts, sizes, 0, r1 - r0)
    broken = np.flatnonzero(~kept & (slabs[1] > 0))
    if len(broken):
        raise bad(f"the rows of {keys[int(broken[0])]!r} do not lie in the slabs its head records")
    index.file = file.astype(np.int32)
    return index


def _checked(data: memoryview, head: Head, r0: int, r1: int, name: str) -> bytes | memoryview:
    """The records among ``data`` (rows ``[r0, r1)``), each block checked against its checksum."""
    first, count = _blocks(head.first_row, r0, r1, head.block_rows)
    if not len(first):
        return data
    key = np.searchsorted(head.first_row, first, side="right") - 1
    number = head.block_base[key] + (first - head.first_row[key]) // head.block_rows
    size, digest = record_dtype(head.width).itemsize, xxhash.xxh3_64_intdigest
    out, at = [], 0
    for block, rows, k in zip(number.tolist(), count.tolist(), key.tolist()):
        records = data[at : at + rows * size]
        stored = int.from_bytes(data[at + rows * size : at + rows * size + _DIGEST], "little")
        if digest(records, (head.nonce + block) & _MASK) != stored:
            raise CorruptCheckpointError(
                f"{name} is damaged: the rows of {head.keys[k]!r} fail their checksum (block {block}; changed "
                f"after saving, or copied from another checkpoint). {FIX}"
            )
        out.append(records)
        at += rows * size + _DIGEST
    return out[0] if len(out) == 1 else b"".join(out)


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
