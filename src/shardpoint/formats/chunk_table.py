"""The chunk index in memory, and the checks of its columns, whichever file holds them.

A ``dist`` checkpoint's stored chunks as arrays (:class:`ChunkIndex`), built from DCP's
``Metadata`` or read from shardpoint's own files: ``.chunk_index`` version 1, every
column in one file (:mod:`~shardpoint.formats.chunk_index`), or version 2, the index's
head there and each chunk's record in ``.chunk_rows``
(:mod:`~shardpoint.formats.chunk_rows`), so that a planner reads only its keys' rows.
Both versions are read through the same checks, kept here once: each column's dtype,
shape and byte range against the file (:func:`columns`), the outline against itself
(:func:`check_outline`), each chunk against its tensor and its file
(:func:`check_chunks`, :func:`check_within_files`). A crafted index must not send a
read outside the checkpoint or size a buffer from a made-up number.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from shardpoint.catalog.metadata import FileRecord
from shardpoint.catalog.untrusted_json import parse_json_object
from shardpoint.errors import CorruptCheckpointError

__all__ = [
    "FILE_COLUMNS",
    "FIX",
    "FORMAT",
    "OUTLINE_COLUMNS",
    "ChunkIndex",
    "File",
    "IndexReads",
    "Outline",
    "Outlined",
    "check_chunks",
    "check_metadata_record",
    "check_outline",
    "check_tensors_fit",
    "check_within_files",
    "columns",
    "complaint",
    "decode_names",
    "encode_names",
    "file_sizes",
    "header",
    "index_reads",
    "outline_columns",
    "padded",
    "read",
    "tensor_of",
]

FORMAT = "shardpoint chunk index"  # the header's "format", in every version
_LIMIT = 1 << 62  # no offset, length or size of a real checkpoint comes near it; sums of two stay below 2**63
#: the dtypes a tensor of an index may have, by name (``str(dtype)``): nothing else is looked up
_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
FIX = "Load an earlier iteration (iteration=N or fallback=True), or run `shardpoint verify`"

File = tuple[str, tuple[str, ...] | None]  # relative path, DCP's transform descriptors


@dataclass
class IndexReads:
    """Bytes of ``.chunk_index`` and ``.chunk_rows`` this process read from storage (tests sum it over ranks)."""

    bytes: int = 0
    reads: int = 0


#: this process's count
index_reads = IndexReads()


@dataclass
class Outline:
    """Every key's dtype (None: a bytes item) and global shape: what each rank needs to place its targets.

    What rank 0 broadcasts of the index (a few dozen bytes per tensor, however many
    ranks saved it); :meth:`metadata` is the ``Metadata`` without chunks that DCP's
    planner takes, one object per tensor, none per chunk.
    """

    keys: list[str]
    dtypes: list[str | None]
    shapes: list[tuple[int, ...]]

    def metadata(self) -> Metadata:
        tensors: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {
            key: BytesStorageMetadata()
            if dtype is None
            else TensorStorageMetadata(TensorProperties(dtype=_DTYPES[dtype]), torch.Size(shape), [])
            for key, dtype, shape in zip(self.keys, self.dtypes, self.shapes)
        }
        return Metadata(state_dict_metadata=tensors, storage_data={})


@dataclass
class ChunkIndex:
    """Every stored chunk, by position (see the module docstring); ``keys`` sorted."""

    keys: list[str]
    dtypes: list[str | None]  # str(dtype); None: a bytes item (no chunks)
    shapes: list[tuple[int, ...]]
    first_row: np.ndarray  # int64 (keys + 1,)
    starts: np.ndarray  # int64 (rows, width), padded with 0
    sizes: np.ndarray  # int64 (rows, width), padded with 1
    file: np.ndarray  # int32 (rows,): index into ``files``; -1: no stored data listed
    offset: np.ndarray  # int64 (rows,)
    length: np.ndarray  # int64 (rows,)
    files: Sequence[File]  # a list, or formats.file_runs.FileRuns (names built when asked for)

    @property
    def outline(self) -> Outline:
        return Outline(self.keys, self.dtypes, self.shapes)

    @classmethod
    def from_metadata(cls, metadata: Metadata, where: str) -> ChunkIndex:
        """The index of an unpickled ``.metadata``: comprehensions and numpy over all chunks, no step per chunk.

        1.2 million chunks and stored items at 4096 × 300; 10,000 on a rank of small
        tensors, where a step per chunk cost more than the reads.
        """
        saved = sorted(metadata.state_dict_metadata)
        tensors = [metadata.state_dict_metadata[key] for key in saved]
        metas = [md if isinstance(md, TensorStorageMetadata) else None for md in tensors]  # None: a stored object
        listed = [md.chunks if md is not None else () for md in metas]
        counts = np.fromiter(map(len, listed), np.int64, len(listed))
        base = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        shapes = [tuple(md.size) if md is not None else () for md in metas]
        chunks = list(itertools.chain.from_iterable(listed))
        ndim = np.repeat(np.fromiter(map(len, shapes), np.int64, len(shapes)), counts)
        offsets, extents = [chunk.offsets for chunk in chunks], [chunk.sizes for chunk in chunks]
        for rows in (offsets, extents):
            _check_dims(rows, ndim, saved, base, where)
        dims = max([1, *map(len, shapes)])
        starts, sizes = padded(offsets, ndim, dims, 0), padded(extents, ndim, dims, 1)
        keys = itertools.chain.from_iterable(map(itertools.repeat, saved, counts.tolist()))
        # (key, offsets) hashes as the MetadataIndex of storage_data: no conversions
        at: dict[tuple[str, torch.Size], int] = dict(zip(zip(keys, offsets), range(len(chunks))))
        file, offset, length, files = _placement(metadata, at, len(chunks))
        dtypes = [str(md.properties.dtype) if md is not None else None for md in metas]
        return cls(saved, dtypes, shapes, base, starts, sizes, file, offset, length, files).in_order()

    def in_order(self) -> ChunkIndex:
        """This index with each key's rows sorted by their starts, dimension 0 first (itself if they are).

        A chunk's position in a load is its row, so every plan of one checkpoint numbers
        them alike; and sorted, a key saved as slabs keeps them in its rows
        (:mod:`~shardpoint.formats.chunk_rows`), whatever order the ranks' plans listed them in.
        """
        rows = len(self.file)
        key = np.repeat(np.arange(len(self.keys)), np.diff(self.first_row))
        order = np.lexsort((*(self.starts[:, d] for d in reversed(range(self.starts.shape[1]))), key))
        if rows == 0 or (order == np.arange(rows)).all():
            return self
        taken = (self.starts[order], self.sizes[order], self.file[order], self.offset[order], self.length[order])
        return ChunkIndex(self.keys, self.dtypes, self.shapes, self.first_row, *taken, self.files)


def tensor_of(md: TensorStorageMetadata | BytesStorageMetadata, key: str) -> TensorStorageMetadata:
    """``md``, the metadata of a saved tensor; a key saved as an object has no chunks, no box, no dtype."""
    if not isinstance(md, TensorStorageMetadata):
        raise CorruptCheckpointError(f"{key!r} is stored as an object, not a tensor")
    return md


_fqn_offset = operator.attrgetter("fqn", "offset")  # of a MetadataIndex
_relative_path, _offset, _length = map(operator.attrgetter, ("relative_path", "offset", "length"))  # of a _StorageInfo


def _placement(
    metadata: Metadata, at: Mapping[tuple[str, torch.Size], int], rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[File]]:
    """Each chunk's file, offset and length from ``storage_data`` (``at``: a chunk's row by its index)."""
    file = np.full(rows, -1, np.int32)  # -1: no stored data listed
    offset, length = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
    storage = metadata.storage_data or {}
    # the others (-1): a pickled object's bytes (refused when asked for), not a tensor's chunk
    found = np.fromiter(map(at.get, map(_fqn_offset, storage), itertools.repeat(-1)), np.int64, len(storage))
    infos = list(storage.values())
    paths: list[Any] = list(map(_relative_path, infos))
    descriptors = list(map(getattr, infos, itertools.repeat("transform_descriptors"), itertools.repeat(None)))
    if any(descriptors):  # torch >= 2.7
        paths = [(path, tuple(d)) if d else path for path, d in zip(paths, descriptors)]
    # a path, or (path, descriptors); sorted, so that every way of building an index numbers files alike
    names = {name: i for i, name in enumerate(sorted(dict.fromkeys(paths), key=str))}
    chunk = found >= 0
    file[found[chunk]] = np.fromiter(map(names.__getitem__, paths), np.int64, len(paths))[chunk]
    offset[found[chunk]] = np.fromiter(map(_offset, infos), np.int64, len(infos))[chunk]
    length[found[chunk]] = np.fromiter(map(_length, infos), np.int64, len(infos))[chunk]
    return file, offset, length, [name if isinstance(name, tuple) else (name, None) for name in names]


def _check_dims(
    rows: Sequence[Sequence[int]], ndim: np.ndarray, saved: Sequence[str], base: np.ndarray, where: str
) -> None:
    """Refuse a chunk whose offsets or sizes have another length than its tensor's dimensions."""
    wrong = np.flatnonzero(np.fromiter(map(len, rows), np.int64, len(rows)) != ndim)
    if len(wrong):
        key = saved[int(np.searchsorted(base, wrong[0], side="right") - 1)]
        raise CorruptCheckpointError(
            f"{where}: .metadata lists a chunk of {key!r} with another number of dimensions than the tensor; "
            "it is damaged"
        )


def padded(rows: Sequence[Sequence[int]], ndim: np.ndarray, dims: int, fill: int) -> np.ndarray:
    """``rows`` of ``ndim`` ints each as one (rows, dims) array, padded with ``fill`` (no step per row)."""
    out = np.full((len(rows), dims), fill, np.int64)
    out[np.arange(dims) < ndim[:, None]] = np.fromiter(itertools.chain.from_iterable(rows), np.int64, int(ndim.sum()))
    return out


# ----------------------------------------------------------------------------- the file's columns
#: the columns every version holds (name: dtype, dimensions), which :func:`outline_columns` writes
OUTLINE_COLUMNS = {
    "key_names": (np.uint8, 1),
    "key_ends": (np.int64, 1),
    "dtype": (np.int8, 1),
    "shape_ends": (np.int64, 1),
    "shapes": (np.int64, 1),
    "first_row": (np.int64, 1),
}
#: the files as version 1 names them, one name each (version 2 names them by runs: formats.file_runs)
FILE_COLUMNS = {"file_names": (np.uint8, 1), "file_ends": (np.int64, 1)}


def outline_columns(
    index: ChunkIndex, metadata: FileRecord, version: str, files: bool = True
) -> tuple[dict[str, np.ndarray], dict]:
    """The columns and header fields every version writes: the outline, the row ranges, the files (``files``)."""
    names, name_ends = encode_names(index.keys)
    dtypes = sorted({d for d in index.dtypes if d is not None})
    code = {d: i for i, d in enumerate(dtypes)}
    header = {
        "format": FORMAT,
        "version": version,
        "metadata_size": str(metadata.size),
        "metadata_xxh3": metadata.xxh3_64,
        "tensors": str(len(index.keys)),
        "rows": str(len(index.file)),
        "dtypes": json.dumps(dtypes),
    }
    arrays = {
        "key_names": names,
        "key_ends": name_ends,
        "dtype": np.array([-1 if d is None else code[d] for d in index.dtypes], np.int8),
        "shape_ends": np.cumsum(np.fromiter(map(len, index.shapes), np.int64, len(index.shapes)), dtype=np.int64),
        "shapes": np.fromiter(itertools.chain.from_iterable(index.shapes), np.int64),
        "first_row": index.first_row.astype(np.int64),
    }
    if files:
        arrays["file_names"], arrays["file_ends"] = encode_names([path for path, _ in index.files])
        if any(d is not None for _, d in index.files):
            header["descriptors"] = json.dumps([None if d is None else list(d) for _, d in index.files])
    return arrays, header


def encode_names(names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """``names`` as one blob of UTF-8 and each name's end in it: two columns, no pickle."""
    encoded = [name.encode("utf-8", "surrogatepass") for name in names]
    ends = np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)), dtype=np.int64)
    return np.frombuffer(b"".join(encoded), np.uint8).copy(), ends


_CODES = {np.uint8: "U8", np.int8: "I8", np.int32: "I32", np.int64: "I64", np.uint64: "U64"}  # safetensors' names
#: as stored (little-endian); numpy's own order where that is it, since a dtype marked '<' takes slower loops
_STORED = {d: np.dtype(d) if sys.byteorder == "little" else np.dtype(d).newbyteorder("<") for d in _CODES}


def columns(data: bytes, name: str, spec: Mapping[str, tuple[Any, int]]) -> dict[str, np.ndarray]:
    """Each column of ``spec`` (name: dtype, dimensions) as a read-only view of ``data``, checked against the file.

    Views, not safetensors' loader, which copies every array: at 16,384 ranks × 300
    tensors the index is 256 MB, and the copy was a third of rank 0's time to decode it
    and doubled its memory. Each array's range must lie in the data section and hold
    exactly its shape's bytes, as safetensors checks; the columns' values are checked
    by the callers.
    """
    (length,) = struct.unpack_from("<Q", data)  # header() checked it fits
    table = parse_json_object(bytes(data[8 : 8 + length]), name, "chunk index header")
    start, size = 8 + length, len(data) - 8 - length
    arrays = {}
    for column, (dtype, ndim) in spec.items():
        entry = table.get(column)
        shape = entry.get("shape") if isinstance(entry, dict) else None
        at = entry.get("data_offsets") if isinstance(entry, dict) else None
        fine = isinstance(entry, dict) and entry.get("dtype") == _CODES[dtype]
        fine = fine and isinstance(shape, list) and len(shape) == ndim and all(type(n) is int and n >= 0 for n in shape)
        fine = fine and isinstance(at, list) and len(at) == 2 and all(type(n) is int for n in at)
        count = math.prod(shape) if fine else 0  # type: ignore[arg-type]  # a list of ints, checked above
        fine = fine and 0 <= at[0] <= at[1] <= size and at[1] - at[0] == count * np.dtype(dtype).itemsize  # type: ignore[index]
        if not fine:
            raise CorruptCheckpointError(f"{name}: column {column!r} is missing or malformed; it is damaged. {FIX}")
        flat = np.frombuffer(data, _STORED[dtype], count, start + at[0]) if count else np.zeros(0, dtype)  # type: ignore[index]
        arrays[column] = flat.reshape(shape).astype(dtype, copy=False)  # a copy only on a big-endian machine
    return arrays


def header(data: bytes, name: str, versions: Sequence[str]) -> dict[str, Any]:
    """The ``__metadata__`` of an index's header (strings only), of our format and one of ``versions``."""
    if len(data) < 8:
        raise CorruptCheckpointError(f"{name} is shorter than any index; it is damaged. {FIX}")
    (length,) = struct.unpack_from("<Q", data)
    if length > len(data) - 8:
        raise CorruptCheckpointError(f"{name}: its header runs past the file's end; it is damaged. {FIX}")
    found = parse_json_object(bytes(data[8 : 8 + length]), name, "chunk index header").get("__metadata__")
    if not isinstance(found, dict) or found.get("format") != FORMAT or found.get("version") not in versions:
        said = " or ".join(versions)
        raise CorruptCheckpointError(f"{name} is not a shardpoint chunk index of version {said}. {FIX}")
    return found


def check_metadata_record(found: Mapping[str, Any], metadata: FileRecord | None, name: str) -> None:
    """Refuse an index that records another ``.metadata`` than the marker's (``metadata``) as written with it."""
    if (
        metadata is None
        or found.get("metadata_xxh3") != metadata.xxh3_64
        or found.get("metadata_size") != str(metadata.size)
    ):
        raise CorruptCheckpointError(
            f"{name} records another .metadata than the one this checkpoint lists (copied from another "
            f"checkpoint, or damaged); refusing to plan from it. {FIX}"
        )


def complaint(name: str) -> Callable[[str], CorruptCheckpointError]:
    """The error for a column of ``name`` that contradicts another or the files it names."""

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{name}: {what}; the index is damaged or crafted. {FIX}")

    return bad


# ----------------------------------------------------------------------------- the checks
@dataclass
class Outlined:
    """The outline's columns, decoded and checked against each other (:func:`check_outline`)."""

    keys: list[str]
    dtypes: list[str | None]
    shapes: list[tuple[int, ...]]
    first_row: np.ndarray  # int64 (keys + 1,)
    counts: np.ndarray  # int64 (keys,): rows per key
    files: Sequence[File]


def check_outline(
    arrays: Mapping[str, np.ndarray],
    found: Mapping[str, Any],
    name: str,
    rows: int,
    files: Sequence[File] | None = None,
) -> Outlined:
    """Keys, dtypes, shapes, row ranges and files, each checked; ``rows``: the chunks the index holds.

    ``files``: the files, where the index names them another way than :data:`FILE_COLUMNS`.
    """
    bad = complaint(name)
    keys = decode_names(arrays["key_names"], arrays["key_ends"], name, "key")
    tensors = len(keys)
    if found.get("tensors") != str(tensors) or found.get("rows") != str(rows):
        raise bad("its counts of tensors and chunks differ from its columns")
    if keys != sorted(set(keys)):
        raise bad("its keys are not sorted and distinct")
    dtypes = _dtypes(arrays["dtype"], found, tensors, bad)
    shapes = _shapes(arrays["shape_ends"], arrays["shapes"], tensors, bad)
    first_row = arrays["first_row"]
    if len(first_row) != tensors + 1 or (tensors + 1 and (first_row[0] != 0 or first_row[-1] != rows)):
        raise bad("its row ranges do not cover its chunks")
    counts = np.diff(first_row)
    if (counts < 0).any() or any(dtype is None and count for dtype, count in zip(dtypes, counts.tolist())):
        raise bad("a row range is negative, or a bytes item has chunks")
    if files is None:
        files = _files(decode_names(arrays["file_names"], arrays["file_ends"], name, "file"), found, bad)
    return Outlined(keys, dtypes, shapes, first_row, counts, files)


def decode_names(blob: np.ndarray, ends: np.ndarray, name: str, what: str) -> list[str]:
    """Names from a blob of UTF-8 and each name's end in it (:func:`encode_names`), checked."""
    if len(ends) and ((np.diff(ends) < 0).any() or ends[0] < 0 or ends[-1] != len(blob)):
        raise CorruptCheckpointError(f"{name}: its {what} names do not fit their table; it is damaged. {FIX}")
    if not len(ends) and len(blob):
        raise CorruptCheckpointError(f"{name}: its {what} names do not fit their table; it is damaged. {FIX}")
    try:
        text = blob.tobytes().decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        raise CorruptCheckpointError(f"{name}: a {what} name is not UTF-8; it is damaged. {FIX}") from None
    raw, bounds = blob.tobytes(), [0, *ends.tolist()]
    if len(text) == len(raw):  # ASCII: characters are bytes
        return [text[a:b] for a, b in itertools.pairwise(bounds)]
    try:
        return [raw[a:b].decode("utf-8", "surrogatepass") for a, b in itertools.pairwise(bounds)]
    except UnicodeDecodeError:
        message = f"{name}: a {what} name is cut inside a character; it is damaged. {FIX}"
        raise CorruptCheckpointError(message) from None


def _dtypes(codes: np.ndarray, found: Mapping[str, Any], tensors: int, bad: Callable[[str], Exception]) -> list:
    try:
        names = json.loads(found.get("dtypes", "[]"))
    except (TypeError, ValueError):
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) and n in _DTYPES for n in names):
        raise bad("its dtypes are not torch dtypes")
    if len(codes) != tensors or (len(codes) and (codes.min() < -1 or codes.max() >= len(names))):
        raise bad("a tensor's dtype code is out of range")
    return [None if c < 0 else names[c] for c in codes.tolist()]


def _shapes(ends: np.ndarray, flat: np.ndarray, tensors: int, bad: Callable[[str], Exception]) -> list:
    if len(ends) != tensors or (tensors and ((np.diff(ends) < 0).any() or ends[0] < 0 or ends[-1] != len(flat))):
        raise bad("its shapes do not fit their table")
    if len(flat) and (flat.min() < 0 or flat.max() >= _LIMIT):
        raise bad("a shape is negative or impossible")
    values, bounds = flat.tolist(), [0, *ends.tolist()]
    return [tuple(values[a:b]) for a, b in itertools.pairwise(bounds)]


def _files(paths: list[str], found: Mapping[str, Any], bad: Callable[[str], Exception]) -> list[File]:
    if "descriptors" not in found:
        return [(path, None) for path in paths]
    try:
        listed = json.loads(found["descriptors"])
    except (TypeError, ValueError):
        listed = None
    fine = isinstance(listed, list) and len(listed) == len(paths)
    fine = fine and all(d is None or (isinstance(d, list) and all(isinstance(s, str) for s in d)) for d in listed)
    if not fine:
        raise bad("its transform descriptors do not fit its files")
    return [(path, None if d is None else tuple(d)) for path, d in zip(paths, listed)]


def check_chunks(index: ChunkIndex, counts: np.ndarray, bad: Callable[[str], Exception]) -> None:
    """Each chunk inside its tensor, with sizes and offsets that are counts; the padding as it is written."""
    rows, dims = len(index.file), max([1, *map(len, index.shapes)])
    starts, sizes = index.starts, index.sizes
    if starts.shape != sizes.shape or starts.shape[0] != rows or starts.shape[1] < dims:
        raise bad("its chunk boxes do not fit its tensors")
    if not rows:
        return
    width = starts.shape[1]
    dims_of = np.fromiter(map(len, index.shapes), np.int64, len(index.shapes))
    shape = padded(index.shapes, dims_of, width, 1)
    if min(starts.min(), sizes.min()) < 0 or max(starts.max(), sizes.max()) >= _LIMIT:
        raise bad("a chunk has a negative or impossible offset or size")
    for d in range(width):  # a dimension at a time: no (rows, width) temporaries (4.9 million rows at 16,384 ranks)
        padding = np.repeat(dims_of <= d, counts)
        if (starts[padding, d] != 0).any() or (sizes[padding, d] != 1).any():
            raise bad("a chunk has more dimensions than its tensor")
        if (starts[:, d] + sizes[:, d] > np.repeat(shape[:, d], counts)).any():
            raise bad("a chunk lies outside its tensor")
    if index.file.min() < -1 or index.file.max() >= len(index.files):
        raise bad("a chunk names a file it does not list")
    if min(index.offset.min(), index.length.min()) < 0 or max(index.offset.max(), index.length.max()) >= _LIMIT:
        raise bad("a chunk has a negative or impossible offset or length in its file")


def file_sizes(files: Sequence[File], size_of: Callable[[str], int]) -> np.ndarray:
    """Each file's size (int64), as ``size_of`` gives it: it raises for a file the marker does not list."""
    return np.fromiter((size_of(path) for path, _ in files), np.int64, len(files))


def check_tensors_fit(
    dtypes: Sequence[str | None], shapes: Sequence[tuple[int, ...]], total: int, bad: Callable[[str], Exception]
) -> None:
    """All tensors together no bigger than the ``total`` bytes stored (what a load allocates for them)."""
    itemsize = [0 if d is None else _DTYPES[d].itemsize for d in dtypes]
    whole = sum(float(math.prod(shape)) * n for shape, n in zip(shapes, itemsize))
    if whole > total:
        raise bad(f"it describes more tensor bytes than the {total} bytes stored; nothing was allocated for them")


def check_within_files(
    index: ChunkIndex, sizes: np.ndarray, bad: Callable[[str], Exception], total: int | None = None
) -> None:
    """Each item within its file (``sizes``: each file's), the chunks and tensors no bigger than the files.

    As :func:`~shardpoint.formats.dcp_metadata.check_stored_items` does for ``.metadata``.
    ``index`` may hold some keys only, and only the files they use
    (:mod:`~shardpoint.formats.chunk_rows`): ``total``, the bytes of every file of the
    checkpoint, is then the bound.
    """
    used = index.file >= 0
    ends = np.zeros(len(index.files), np.int64)
    np.maximum.at(ends, index.file[used], index.offset[used] + index.length[used])
    over = np.flatnonzero(ends > sizes)
    if len(over):
        path, end, size = index.files[over[0]][0], int(ends[over[0]]), int(sizes[over[0]])
        raise bad(f"it places stored bytes of {path} up to byte {end}, past its {size} bytes")
    total = int(sizes.sum()) if total is None else total
    check_tensors_fit(index.dtypes, index.shapes, total, bad)
    itemsize = [0 if d is None else _DTYPES[d].itemsize for d in index.dtypes]
    volume = np.repeat(np.array(itemsize, np.float64), np.diff(index.first_row))
    for d in range(index.sizes.shape[1]):  # a column at a time: a product over a short axis is slower
        volume *= index.sizes[:, d]
    if float(volume.sum()) > total:
        raise bad(f"it describes more tensor bytes than the {total} bytes stored; nothing was allocated for them")


def read(open_stream: Callable[[], Any], record: FileRecord, name: str) -> bytes:
    """An index file's bytes from storage, refused unless their size and XXH3 are the marker's ``record``.

    Checked whatever the load's ``verify`` says: the index decides where every read
    goes, and hashing it costs little next to reading it.
    """
    with open_stream() as stream:
        data = stream.read(record.size + 1)
    index_reads.bytes += len(data)
    index_reads.reads += 1
    if len(data) != record.size or xxhash.xxh3_64_hexdigest(data) != record.xxh3_64:
        raise CorruptCheckpointError(f"{name} is damaged: checksum mismatch (the contents changed after saving). {FIX}")
    return data
