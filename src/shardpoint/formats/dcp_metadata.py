"""DCP's ``.metadata``, read and checked once per job rather than once per rank.

Every rank of a load needs the checkpoint's DCP metadata to plan its reads. Read by
every rank, it is the one file whose reads grow with the job twice over: it grows with
the ranks that saved (one chunk record per shard) and is read by every rank that loads,
204 MB × 4096 ranks, 835 GB from shared storage for one load. Here rank 0 reads it,
checks its size and checksum while it holds the bytes, and broadcasts its outline (the
tensors, not their chunks) over the control group (:func:`share_outline`); each rank
unpickles that with the restricted unpickler as if it had read the file, and later
receives from rank 0 only the chunks its own targets need (:mod:`shardpoint.formats.load_parts`).
:data:`metadata_reads` counts what this process read, so a test can sum it over ranks.

:class:`SafeMetadata` is the mixin that gives DCP's readers this ``read_metadata``;
plain ``dcp.load`` with those readers works as before (each reader reads the file itself).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from shardpoint.catalog.metadata import FileRecord, listed_record
from shardpoint.errors import CheckpointError, CorruptCheckpointError, StorageError, UnsafeCheckpointError
from shardpoint.parallel import comm
from shardpoint.storage.safe_io import load_dcp_metadata

__all__ = [
    "DCP_METADATA",
    "MetadataReads",
    "SafeMetadata",
    "check_stored_items",
    "metadata_reads",
    "outline_of",
    "share_outline",
]

DCP_METADATA = ".metadata"


@dataclass
class MetadataReads:
    """What this process read of DCP ``.metadata`` files from storage, over every load it ran.

    A load reads ``.metadata`` on one rank and broadcasts it (:func:`share_outline`), so
    summed over the ranks of a job this is the file's size once per load, not once per
    rank (204 MB × 4096 ranks was 835 GB of reads from shared storage for one load).
    """

    bytes: int = 0
    reads: int = 0


#: this process's count (tests sum it over ranks)
metadata_reads = MetadataReads()


class SafeMetadata:
    """DCP's ``read_metadata``, with ``.metadata`` unpickled by the restricted unpickler, once per reader.

    shardpoint reads the metadata to plan before ``dcp.load``, which reads it again.
    ``metadata_record``: when set, the file's size and checksum are checked as it is read
    (before anything is unpickled); ``metadata_checked`` then names it. ``listed``: the
    marker's files; when set, every stored item must lie in one of them, within its
    recorded size (:func:`check_stored_items`), before any data file is opened.
    """

    _metadata: Metadata | None = None
    metadata_record: FileRecord | None = None
    listed: Mapping[str, FileRecord] | None = None
    metadata_checked: frozenset[str] = frozenset()
    # given by the FileSystemReader this is mixed into (declared for the type checker only)
    fs: Any
    path: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = self._parse_metadata(self.read_metadata_bytes())
        return self._metadata

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)  # type: ignore[misc]
        self._metadata = None  # another checkpoint (dcp.load(checkpoint_id=...) reuses readers)
        self.metadata_checked = frozenset()

    def read_metadata_bytes(self) -> bytes:
        """The bytes of ``.metadata`` from storage, checked against :attr:`metadata_record` if set."""
        path = self._metadata_path()
        if self.listed is not None:
            listed_record(self.listed, DCP_METADATA, str(self.path), "the dist format")
        try:
            with self.fs.create_stream(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path} is missing; the dist checkpoint is incomplete") from None
        metadata_reads.bytes += len(data)
        metadata_reads.reads += 1
        record = self.metadata_record
        if record is not None:
            if len(data) != record.size or xxhash.xxh3_64_hexdigest(data) != record.xxh3_64:
                raise CorruptCheckpointError(
                    f"checkpoint {self.path} is damaged: {DCP_METADATA}: checksum mismatch (the contents changed "
                    "after saving). Load an earlier iteration (iteration=N or fallback=True) or run `shardpoint verify`"
                )
            self.metadata_checked = frozenset({DCP_METADATA})
        return data

    def use_metadata_bytes(self, data: bytes) -> Metadata:
        """Take ``.metadata`` as another rank read it (checked there); unpickled here as if read here."""
        self._metadata = self._parse_metadata(data)
        return self._metadata

    def _metadata_path(self) -> Any:
        return self.fs.concat_path(self.path, DCP_METADATA)

    def _parse_metadata(self, data: bytes) -> Metadata:
        path = self._metadata_path()
        metadata = load_dcp_metadata(data, str(path))
        if not isinstance(metadata, Metadata):
            raise CorruptCheckpointError(f"{path} does not hold DCP metadata")
        listed = self.listed
        if listed is not None:
            where = str(self.path)
            check_stored_items(metadata, lambda name: listed_record(listed, name, where, DCP_METADATA).size, where)
        return metadata


def check_stored_items(metadata: Metadata, size_of: Callable[[str], int], where: str) -> None:
    """Refuse a ``.metadata`` whose items lie outside the files they name, or whose tensors outgrow the checkpoint.

    DCP's readers take ``.metadata``'s file names, offsets, lengths and shapes as given:
    a crafted one could send a read into another run's files, or make a reader allocate
    whatever a length or a shape says (1.55 GB for a 21 KB checkpoint). ``size_of(name)``
    is the size of a file an item names, or raises for a file the reader may not open
    (the marker does not list it; a foreign file outside its directory). Each item must
    lie within its file, and the tensors (at full size, and their chunks) cannot hold
    more bytes than those files together (stored items are uncompressed tensors), so all
    allocations sized from ``.metadata`` together stay within the checkpoint's own size.

    Every tensor and chunk is checked at once, in numpy (:func:`_all_fit`: C loops, no
    Python step per tensor: rank 0 checks the whole job's ``.metadata``); only a
    ``.metadata`` that fails is walked tensor by tensor, to name the first bad one.

    Raises:
        CorruptCheckpointError: naming the file or the tensor, and ``where``.
    """
    total = sum(_check_items_in_files(metadata, size_of, where).values())
    if not _all_fit(metadata, total):
        _check_each(metadata, total, where)


def _all_fit(metadata: Metadata, total: int) -> bool:
    """Whether every tensor's size and chunks are counts, its chunks inside it, and all together within ``total``.

    False for anything unusual (a type, a length, an overflow): :func:`_check_each` then decides.
    """
    found = list(metadata.state_dict_metadata.values())
    tensors = list(itertools.compress(found, map(isinstance, found, itertools.repeat(TensorStorageMetadata))))
    try:
        sizes = list(map(operator.attrgetter("size"), tensors))
        itemsize = np.fromiter(map(operator.attrgetter("properties.dtype.itemsize"), tensors), np.float64, len(tensors))
        ndim = np.fromiter(map(len, sizes), np.int64, len(tensors))
        chunks = list(map(operator.attrgetter("chunks"), tensors))
        counts = np.fromiter(map(len, chunks), np.int64, len(tensors))
        every = list(itertools.chain.from_iterable(chunks))
        starts = list(map(operator.attrgetter("offsets"), every))
        rows = list(map(operator.attrgetter("sizes"), every))
        if not set(map(type, itertools.chain(*sizes, *starts, *rows))) <= {int}:
            return False  # a bool, a float, a string: not a count
        dims = np.repeat(ndim, counts)
        if not (_lengths(starts, dims) and _lengths(rows, dims)):
            return False
        size = np.fromiter(itertools.chain.from_iterable(sizes), np.int64, int(ndim.sum()))
        start = np.fromiter(itertools.chain.from_iterable(starts), np.int64, int(dims.sum()))
        length = np.fromiter(itertools.chain.from_iterable(rows), np.int64, int(dims.sum()))
    except (TypeError, ValueError, OverflowError, AttributeError):
        return False
    if min(size.min(initial=0), start.min(initial=0), length.min(initial=0)) < 0:
        return False
    # each chunk's coordinates against its tensor's size, all chunks flat (in float: no wrap-around near 2**63)
    first = np.repeat(np.cumsum(ndim) - ndim, counts)  # each chunk's tensor's first coordinate in ``size``
    within = np.arange(len(start)) - np.repeat(np.cumsum(dims) - dims, dims)
    limit = size[np.repeat(first, dims) + within]
    if (start.astype(np.float64) + length > limit).any():
        return False
    full = _products(size.astype(np.float64), ndim) * itemsize
    held = _products(length.astype(np.float64), dims) * np.repeat(itemsize, counts)
    # a margin for float rounding: a .metadata within it of the bound is decided exactly
    return bool(max(full.sum(), held.sum()) <= total * (1 - 1e-9))


def _lengths(values: list, dims: np.ndarray) -> bool:
    """Whether each of ``values`` has the length ``dims`` says."""
    return np.array_equal(np.fromiter(map(len, values), np.int64, len(values)), dims)


def _products(flat: np.ndarray, ndim: np.ndarray) -> np.ndarray:
    """The product of each run of ``ndim`` values of ``flat`` (1 for none), in float."""
    product = np.ones(len(ndim))
    some = ndim > 0
    if some.any():
        product[some] = np.multiply.reduceat(flat, (np.cumsum(ndim) - ndim)[some])
    return product


def _check_each(metadata: Metadata, total: int, where: str) -> None:
    """:func:`check_stored_items`'s tensor checks one tensor at a time: the error naming the first that fails."""
    claimed = [0, 0]
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            for i, nbytes in enumerate(_tensor_bytes(key, md, where)):
                claimed[i] += nbytes
            if max(claimed) > total:
                raise CorruptCheckpointError(
                    f"checkpoint {where} is damaged or crafted: with {key!r} (size {tuple(md.size)}), "
                    f"{DCP_METADATA} describes more tensor bytes than the {total} bytes stored; nothing was allocated "
                    "for them. Load another iteration"
                )


def _check_items_in_files(metadata: Metadata, size_of: Callable[[str], int], where: str) -> dict[str, int]:
    """Each stored item within its file (one pass over the items, the arithmetic in numpy); the files' sizes."""
    infos = list((metadata.storage_data or {}).values())
    names = [info.relative_path for info in infos]
    try:
        if not set(map(type, names)) <= {str}:
            raise TypeError("a file name that is not a string")
        offsets = np.array([info.offset for info in infos], np.int64)
        lengths = np.array([info.length for info in infos], np.int64)
        if offsets.dtype != np.int64 or lengths.dtype != np.int64:
            raise TypeError("not integers")
    except (TypeError, ValueError, OverflowError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{where}: {DCP_METADATA} holds a malformed storage record ({exc})") from None
    if len(infos) and (min(offsets.min(), lengths.min()) < 0 or max(offsets.max(), lengths.max()) >= 1 << 62):
        raise CorruptCheckpointError(f"{where}: {DCP_METADATA} holds a negative or impossible offset or length")
    index = dict(zip(dict.fromkeys(names), itertools.count()))
    ids = np.fromiter(map(index.__getitem__, names), np.int64, len(names))
    ends = np.zeros(len(index), np.int64)
    np.maximum.at(ends, ids, offsets + lengths)
    sizes = {name: size_of(name) for name in index}
    for name, end in zip(index, ends.tolist()):
        if end > sizes[name]:
            raise CorruptCheckpointError(
                f"checkpoint {where} is damaged or crafted: {DCP_METADATA} places stored bytes of {name} up to byte "
                f"{end}, past its {sizes[name]} bytes; nothing was read. Load another iteration"
            )
    return sizes


def _tensor_bytes(key: str, md: TensorStorageMetadata, where: str) -> tuple[int, int]:
    """The bytes of a tensor at full size, and of its chunks together (see :func:`check_stored_items`)."""
    try:
        itemsize, ndim, count = md.properties.dtype.itemsize, len(md.size), len(md.chunks)
        if not _counts(*md.size) or any(len(c.sizes) != ndim or len(c.offsets) != ndim for c in md.chunks):
            raise ValueError("not a count")
        rows = np.fromiter(itertools.chain.from_iterable(c.sizes for c in md.chunks), np.int64, count * ndim)
        starts = np.fromiter(itertools.chain.from_iterable(c.offsets for c in md.chunks), np.int64, count * ndim)
    except (TypeError, ValueError, OverflowError, AttributeError):
        raise CorruptCheckpointError(
            f"{where}: {DCP_METADATA} gives {key!r} or one of its chunks a size or an offset that is not a count "
            "(or not one per dimension); it is damaged"
        ) from None
    if rows.size and (rows.min() < 0 or starts.min() < 0):
        raise CorruptCheckpointError(f"{where}: {DCP_METADATA} gives a chunk of {key!r} a negative size; it is damaged")
    # every chunk inside the tensor (in float: a crafted offset near 2**63 must not wrap around)
    ends = starts.reshape(count, ndim).astype(np.float64) + rows.reshape(count, ndim)
    if count and ndim and (ends > np.asarray(md.size, dtype=np.float64)).any():
        raise CorruptCheckpointError(
            f"{where}: {DCP_METADATA} places a chunk of {key!r} outside its size {tuple(md.size)}; it is damaged"
        )
    chunk_elements = rows.reshape(count, ndim).prod(axis=1, dtype=np.float64).sum()  # a bound: floats cannot overflow
    return math.prod(md.size) * itemsize, int(min(chunk_elements * itemsize, 2.0**80))


def _counts(*values: Any) -> bool:
    """Every value a non-negative int (a count, an offset, a length)."""
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


def share_outline(reader: SafeMetadata) -> tuple[Metadata, Metadata | None]:
    """Collective: rank 0 reads (and checks) ``.metadata`` once; every rank gets its outline in one broadcast.

    The outline (:func:`outline_of`) is every tensor's name,
    size and dtype: what a rank needs to place its targets. The chunks, which grow with
    the ranks that saved, stay on rank 0, which sends each rank only those its targets
    overlap (:func:`~shardpoint.formats.load_parts.plan`). Returns the outline, and on
    rank 0 the whole metadata (None elsewhere).

    Every rank but rank 0 unpickles the outline with the restricted unpickler, as if read
    from the file; rank 0 keeps its own (nothing is pickled at one rank). A failure on
    rank 0 is raised on every rank, as the same class where it says what is wrong with
    the checkpoint (damaged, unsafe, unreachable), so a bad checkpoint reads alike everywhere.
    """
    data, error, whole, outline = None, None, None, None
    if comm.rank() == 0:
        try:
            whole = reader.use_metadata_bytes(reader.read_metadata_bytes())
            outline = outline_of(whole)
            if comm.world_size() > 1:
                data = pickle.dumps(outline, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            data, error = None, exc
    failure = None if error is None else (_kind_of(error), f"{type(error).__name__}: {error}")
    failure, data = comm.broadcast((failure, data), what="reading .metadata")
    if error is not None:
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(f"reading {DCP_METADATA} failed on rank 0: {failure[1]}") from error
    if failure is not None:
        kind, text = failure
        raise kind(f"rank 0 could not read {DCP_METADATA}: {text}")
    if outline is None:
        outline = load_dcp_metadata(data, f"the outline of {reader._metadata_path()}")
    return outline, whole


def outline_of(metadata: Metadata) -> Metadata:
    """``metadata`` without its chunks or where they are stored: what every rank needs to place its targets.

    A few hundred bytes per tensor, however many ranks saved it.
    """
    tensors = {
        key: TensorStorageMetadata(md.properties, md.size, []) if isinstance(md, TensorStorageMetadata) else md
        for key, md in metadata.state_dict_metadata.items()
    }
    return dataclasses.replace(metadata, state_dict_metadata=tensors, storage_data={})


def _kind_of(error: BaseException) -> type[CheckpointError]:
    """The class the other ranks raise for rank 0's ``error``: a damaged, unsafe or unreachable file stays one."""
    for kind in (UnsafeCheckpointError, CorruptCheckpointError, StorageError):
        if isinstance(error, kind):
            return kind
    return CheckpointError
