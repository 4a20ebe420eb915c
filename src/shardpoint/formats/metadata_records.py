"""DCP's ``.metadata`` written on rank 0 from compact per-rank records, without building its objects.

``dcp.save`` gathers every rank's plan to rank 0 as pickled ``WriteItem`` objects,
builds a ``Metadata`` of one ``ChunkStorageMetadata``, ``MetadataIndex`` and
``_StorageInfo`` per item, and pickles it: at 4096 ranks × 300 tensors that is 1.2
million items, about 190 MB of gathered plans, and seconds of object construction and
pickling on one rank (measured in ``shardpoint bench --simulate-ranks``).

Here each rank sends what ``.metadata`` needs of its own items as a :class:`RankRecords`:
numbers in numpy arrays and its keys as text, compressed (tens of bytes per item).
Rank 0 writes the pickle stream of the ``Metadata`` that DCP would have pickled
directly from those arrays (:func:`assemble`): every item of a tensor is a record of
the same opcodes with different numbers, so a tensor's records are one numpy array,
filled column by column. No per-item Python object is built, on any rank, and rank 0
holds the records and the stream it writes, not a second copy as objects.

The stream is an ordinary pickle (protocol 2) of the same classes, so ``dcp.load``,
shardpoint's restricted reader and ``pickle.load`` read it as DCP's own; the tests
compare it, unpickled, with DCP's ``Metadata`` for the same plans. Class references,
field names, file names and keys are written once and referred to by memo index.
"""

from __future__ import annotations

import io
import itertools
import pickle
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties

from shardpoint.formats.chunk_index import ChunkIndex

__all__ = ["RankRecords", "assemble", "assemble_with_index", "encode"]

_SENTINEL = "\x00shardpoint-placeholder-{}\x00"
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class RankRecords:
    """One rank's written items, as ``.metadata`` needs them, compressed.

    Per item, in plan order: its key (``keys``), its property set (an index into
    ``properties``) and file (an index into ``files``), its byte offset and length in
    that file (``placement``: ``int64 [n, 4]``), and its number of dimensions
    (``ndims``); ``boxes`` holds the chunk's offsets, the chunk's sizes and the tensor's
    global shape, each padded to ``dims`` (``int32``, or ``int64`` when ``wide``).
    """

    keys: bytes  # zlib of the NUL-joined keys
    files: tuple[str, ...]
    properties: tuple[TensorProperties, ...]
    ndims: bytes  # uint8 per item
    placement: bytes
    boxes: bytes
    dims: int
    wide: bool

    @property
    def count(self) -> int:
        return len(self.ndims)

    @property
    def nbytes(self) -> int:
        """Bytes this rank sends (for the bench and the counted tests)."""
        fixed = 64 + sum(len(f) + 8 for f in self.files) + 64 * len(self.properties)
        return fixed + len(self.keys) + len(self.ndims) + len(self.placement) + len(self.boxes)


def encode(items: Sequence, results: Sequence) -> RankRecords:
    """This rank's records from its final plan's tensor ``items`` and its write ``results``."""
    where = {r.index: r.storage_data for r in results}
    files: dict[str, int] = {}
    props: dict[tuple, int] = {}
    prop_list: list[TensorProperties] = []
    dims = max((len(item.tensor_data.size) for item in items), default=0)
    placement = np.zeros((len(items), 4), dtype=np.int64)
    boxes = np.zeros((len(items), 3 * dims), dtype=np.int64)
    ndims = np.zeros(len(items), dtype=np.uint8)
    for i, item in enumerate(items):
        data, stored = item.tensor_data, where[item.index]
        spec = _properties_key(data.properties)
        if spec not in props:
            props[spec] = len(prop_list)
            prop_list.append(data.properties)
        d = ndims[i] = len(data.size)
        placement[i] = (props[spec], files.setdefault(stored.relative_path, len(files)), stored.offset, stored.length)
        row = boxes[i]
        row[:d], row[dims : dims + d], row[2 * dims : 2 * dims + d] = data.chunk.offsets, data.chunk.sizes, data.size
    wide = bool(boxes.size) and int(boxes.max()) > _INT32_MAX
    keys = "\x00".join(item.index.fqn for item in items).encode()
    return RankRecords(
        zlib.compress(keys, 1),
        tuple(files),
        tuple(prop_list),
        ndims.tobytes(),
        zlib.compress(placement.tobytes(), 1),
        zlib.compress(boxes.astype(np.int64 if wide else np.int32).tobytes(), 1),
        dims,
        wide,
    )


def _properties_key(p: TensorProperties) -> tuple:
    return (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)


# ----------------------------------------------------------------------------- the pickle stream
class _Memo:
    """Memo slots of the stream: written once (LONG_BINPUT), referred to after (LONG_BINGET)."""

    def __init__(self) -> None:
        self.slots: dict[object, int] = {}

    def put(self, name: object) -> bytes:
        self.slots[name] = slot = len(self.slots)
        return b"r" + struct.pack("<I", slot)

    def get(self, name: object) -> bytes:
        slot = self.slots[name]
        return b"h" + bytes([slot]) if slot < 256 else b"j" + struct.pack("<I", slot)

    def __contains__(self, name: object) -> bool:
        return name in self.slots


def _string(text: str) -> bytes:
    data = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(data)) + data


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


_CLASSES = {
    "tensor": ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    "chunk": ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    "index": ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    "info": ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    "size": ("torch", "Size"),
}
_FIELDS = ("properties", "size", "chunks", "offsets", "sizes", "fqn", "index", "offset", "relative_path", "length")


def _fragment(obj: object) -> bytes:
    """``obj`` pickled without memo (so that it can sit anywhere in the stream), no PROTO, no STOP."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=2)
    pickler.fast = True
    pickler.dump(obj)
    return buffer.getvalue()[2:-1]


def _split(fragment: bytes, *names: str) -> list[bytes]:
    """``fragment`` cut where each placeholder string was pickled."""
    pieces, rest = [], fragment
    for name in names:
        before, found, rest = rest.partition(_string(_SENTINEL.format(name)))
        if not found:
            raise AssertionError(f"placeholder {name} not found in a pickled template")
        pieces.append(before)
    return [*pieces, rest]


class _Columns:
    """A record layout: constant bytes and integer columns, filled for ``n`` records at once."""

    def __init__(self) -> None:
        self.parts: list[bytes | tuple[np.ndarray, int]] = []

    def const(self, data: bytes) -> _Columns:
        if self.parts and isinstance(self.parts[-1], bytes):
            self.parts[-1] += data
        else:
            self.parts.append(data)
        return self

    def int_column(self, values: np.ndarray) -> _Columns:
        """Pickled ints in the narrowest opcode every value of the column fits, as pickle chooses per value."""
        low, high = (int(values.min()), int(values.max())) if values.size else (0, 0)
        if low >= 0 and high < 2**8:
            opcode, width = b"K", 1  # BININT1
        elif low >= 0 and high < 2**16:
            opcode, width = b"M", 2  # BININT2
        elif low >= -_INT32_MAX - 1 and high <= _INT32_MAX:
            opcode, width = b"J", 4  # BININT
        else:
            opcode, width = b"\x8a\x08", 8  # LONG1 of 8 bytes
        self.const(opcode)
        self.parts.append((values, width))
        return self

    def memo_column(self, slots: np.ndarray) -> _Columns:
        """A memo reference per row: BINGET while every slot is below 256, LONG_BINGET otherwise."""
        short = not slots.size or int(slots.max()) < 256
        self.const(b"h" if short else b"j")
        self.parts.append((slots, 1 if short else 4))
        return self

    def size(self, memo: _Memo, columns: np.ndarray) -> _Columns:
        """A ``torch.Size`` of each row of ``columns`` (``[n, d]``)."""
        self.const(memo.get("size") + b"(")
        for dim in range(columns.shape[1]):
            self.int_column(columns[:, dim])
        return self.const(b"t\x85R")

    def fill(self, n: int) -> memoryview:
        widths = [len(p) if isinstance(p, bytes) else p[1] for p in self.parts]
        out = np.empty((n, sum(widths)), dtype=np.uint8)
        at = 0
        for part, width in zip(self.parts, widths):
            if isinstance(part, bytes):
                out[:, at : at + width] = np.frombuffer(part, dtype=np.uint8)
            else:
                kind = {1: "u1", 2: "<u2", 4: "<i4", 8: "<i8"}[width]
                out[:, at : at + width] = part[0].astype(kind).view(np.uint8).reshape(n, width)
            at += width
        return out.reshape(-1).data  # no copy: the array lives as long as the stream's pieces


@dataclass
class _Items:
    """Every rank's items in rank order, as arrays allocated once (rank 0's memory is the point here)."""

    keys: list[str]  # global key table, in first-seen order
    key: np.ndarray  # int32 per item: index into keys
    ndim: np.ndarray
    ids: np.ndarray  # int32 [n, 2]: global property and file index
    place: np.ndarray  # int64 [n, 2]: byte offset and length
    boxes: np.ndarray  # [n, 3 * dims]: chunk offsets, chunk sizes, global shape
    dims: int
    files: list[str]
    properties: list[TensorProperties]


def _gather(parts: Sequence[RankRecords | None]) -> _Items:
    """Decompress every rank's records into one set of arrays."""
    present = [p for p in parts if p is not None and p.count]
    n, dims = sum(p.count for p in present), max((p.dims for p in present), default=0)
    wide = any(p.wide for p in present)
    key = np.zeros(n, dtype=np.int32)
    ndim = np.zeros(n, dtype=np.uint8)
    ids = np.zeros((n, 2), dtype=np.int32)
    place = np.zeros((n, 2), dtype=np.int64)
    boxes = np.zeros((n, 3 * dims), dtype=np.int64 if wide else np.int32)
    key_ids: dict[str, int] = {}
    known_tables: dict[bytes, np.ndarray] = {}  # ranks of one layout position share their key table
    files: list[str] = []
    properties: list[TensorProperties] = []
    at = 0
    for part in present:
        rows = slice(at, at + part.count)
        table = known_tables.get(part.keys)
        if table is None:
            names = zlib.decompress(part.keys).decode().split("\x00")
            table = known_tables[part.keys] = np.array([key_ids.setdefault(k, len(key_ids)) for k in names])
        key[rows] = table
        ndim[rows] = np.frombuffer(part.ndims, dtype=np.uint8)
        placement = np.frombuffer(zlib.decompress(part.placement), dtype=np.int64).reshape(-1, 4)
        ids[rows] = placement[:, :2] + (len(properties), len(files))
        place[rows] = placement[:, 2:]
        own = np.frombuffer(zlib.decompress(part.boxes), dtype=np.int64 if part.wide else np.int32)
        own = own.reshape(part.count, 3 * part.dims)
        for field in range(3):  # re-pad offsets, sizes and shape to the widest rank's dims
            boxes[rows, field * dims : field * dims + part.dims] = own[:, field * part.dims : (field + 1) * part.dims]
        properties.extend(part.properties)
        files.extend(part.files)
        at += part.count
    return _Items(list(key_ids), key, ndim, ids, place, boxes, dims, files, properties)


def assemble(parts: Sequence[RankRecords | None]) -> list[bytes | memoryview]:
    """Rank 0: the pickle stream of the job's ``.metadata``, in pieces (write them in order).

    Records are filled per number of dimensions, not per key: the Python work is a few
    numpy calls per group and a slice per key, however many keys and ranks.
    """
    return _assemble(_gather(parts))


def assemble_with_index(parts: Sequence[RankRecords | None]) -> tuple[list[bytes | memoryview], ChunkIndex]:
    """:func:`assemble`, and the :class:`~shardpoint.formats.chunk_index.ChunkIndex` of the same items."""
    items = _gather(parts)
    index = _index_of(items)  # first: assembling reorders the items in place
    return _assemble(items), index


def _index_of(items: _Items) -> ChunkIndex:
    """The chunks of ``items`` as the index lists them: keys sorted, each key's chunks in ``.metadata``'s order.

    ``.metadata`` lists a key's chunks in rank order (:func:`_by_dims` sorts stably), as
    ``items`` holds them: a stable sort by key keeps that order. Columns only, no step per item.
    """
    keys = sorted(items.keys)
    rank_of = np.empty(len(items.keys), np.int64)
    rank_of[sorted(range(len(items.keys)), key=items.keys.__getitem__)] = np.arange(len(items.keys))
    sorted_key = rank_of[items.key]
    order = np.argsort(sorted_key, kind="stable")
    counts = np.bincount(sorted_key, minlength=len(keys))
    first_row = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    dims, ndim = items.dims, items.ndim[order].astype(np.int64)
    width = max(1, dims)
    starts = np.zeros((len(order), width), np.int64)
    sizes = np.ones((len(order), width), np.int64)
    real = np.arange(width) < ndim[:, None]
    starts[:, :dims] = items.boxes[order, :dims]
    sizes[real] = items.boxes[order, dims : 2 * dims][real[:, :dims]]
    first = order[first_row[:-1]]  # each key's first item: its global shape and dtype
    shape_rows = items.boxes[first, 2 * dims : 3 * dims].tolist()
    shapes = [tuple(row[:n]) for row, n in zip(shape_rows, items.ndim[first].tolist())]
    dtypes = [str(items.properties[i].dtype) for i in items.ids[first, 0].tolist()]
    names = {name: i for i, name in enumerate(sorted(set(items.files)))}  # ranks may refer to one file
    file_of = np.fromiter(map(names.__getitem__, items.files), np.int32, len(items.files))
    file = file_of[items.ids[order, 1]]
    offset, length = items.place[order, 0], items.place[order, 1]
    files: list[tuple[str, tuple[str, ...] | None]] = [(name, None) for name in names]
    return ChunkIndex(keys, list(dtypes), shapes, first_row, starts, sizes, file, offset, length, files)


def _assemble(items: _Items) -> list[bytes | memoryview]:
    memo = _Memo()
    preamble = [b"\x80\x02"]
    for name, (module, cls) in _CLASSES.items():
        preamble.append(_global(module, cls) + memo.put(name) + b"0")
    for name in _FIELDS:
        preamble.append(_string(name) + memo.put(("field", name)) + b"0")
    file_slots = _define(preamble, memo, "file", items.files)
    key_slots = _define(preamble, memo, "key", items.keys)
    property_slots = np.zeros(len(items.properties), dtype=np.int32)
    for i, properties in enumerate(items.properties):  # one pickled TensorProperties per distinct value
        spec = ("properties", _properties_key(properties))
        if spec not in memo:
            preamble.append(_fragment(properties) + memo.put(spec) + b"0")
        property_slots[i] = memo.slots[spec]
    slots = _Slots(key_slots[items.key], property_slots[items.ids[:, 0]], file_slots[items.ids[:, 1]])
    items.ids = None  # type: ignore[assignment]  # the slots say it now; rank 0's memory is the point
    template = Metadata(
        state_dict_metadata=_SENTINEL.format("tensors"),  # type: ignore[arg-type]
        storage_data=_SENTINEL.format("storage"),
        version=CURRENT_DCP_VERSION,
    )
    head, middle, tail = _split(_fragment(template), "tensors", "storage")
    tensors: list[bytes | memoryview] = []
    storage: list[bytes | memoryview] = []
    for d, rows in _by_dims(items, slots):
        group = _Group(items, slots, rows, d)
        tensors.extend(_tensors(group, memo))
        storage.append(_storage(group, memo))
    return [b"".join(preamble), head, b"}(", *tensors, b"u", middle, b"}(", *storage, b"u", tail, b"."]


def _define(preamble: list[bytes], memo: _Memo, kind: str, names: Sequence[str]) -> np.ndarray:
    """Write each of ``names`` once into the memo; their slots."""
    for i, name in enumerate(names):
        preamble.append(_string(name) + memo.put((kind, i)) + b"0")
    return np.array([memo.slots[(kind, i)] for i in range(len(names))], dtype=np.int32)


@dataclass
class _Slots:
    """Per item: the memo slots of its key, its properties and its file."""

    key: np.ndarray
    properties: np.ndarray
    file: np.ndarray


def _by_dims(items: _Items, slots: _Slots) -> Iterator[tuple[int, slice]]:
    """Put every array in (dims, key, rank) order, in place; then each run of one number of dimensions."""
    group = items.ndim.astype(np.int64) * max(len(items.keys), 1) + items.key
    order = np.argsort(group, kind="stable")  # stable: each key's chunks stay in rank order, as DCP's
    runs = 1 + int(np.count_nonzero(np.diff(group[order]))) if len(group) else 0
    del group
    if runs != len(items.keys):
        raise ValueError("a tensor has items of different numbers of dimensions; its boxes cannot be one tensor")
    for name in ("key", "ndim", "place", "boxes"):
        setattr(items, name, getattr(items, name)[order])  # one array at a time: a copy of one, never of all
    for name in ("key", "properties", "file"):
        setattr(slots, name, getattr(slots, name)[order])
    del order
    if not len(items.ndim):
        return
    bounds = [0, *(np.flatnonzero(np.diff(items.ndim)) + 1).tolist(), len(items.ndim)]
    for a, b in itertools.pairwise(bounds):
        yield int(items.ndim[a]), slice(a, b)


class _Group:
    """The items of one number of dimensions, in key order: their keys' runs and chunk positions."""

    def __init__(self, items: _Items, slots: _Slots, rows: slice, d: int):
        self.d, self.n = d, rows.stop - rows.start
        dims = items.dims
        self.offsets = items.boxes[rows, 0:d]
        self.sizes = items.boxes[rows, dims : dims + d]
        self.shapes = items.boxes[rows, 2 * dims : 2 * dims + d]
        self.place = items.place[rows]
        self.key, self.properties, self.file = slots.key[rows], slots.properties[rows], slots.file[rows]
        starts = np.flatnonzero(np.diff(self.key)) + 1
        self.starts = np.concatenate([[0], starts]).astype(np.int64)
        self.stops = np.concatenate([starts, [self.n]]).astype(np.int64)
        self.position = np.arange(self.n, dtype=np.int32)  # DCP's index hint: the chunk's place in its key's list
        self.position -= np.repeat(self.starts.astype(np.int32), self.stops - self.starts)


def _tensors(group: _Group, memo: _Memo) -> list[bytes | memoryview]:
    """``key: TensorStorageMetadata`` for every key of the group: a header per key, then its chunks."""
    first = group.starts
    header = (
        _Columns()
        .memo_column(group.key[first])
        .const(memo.get("tensor") + b")\x81}(" + memo.get(("field", "properties")))
        .memo_column(group.properties[first])
        .const(memo.get(("field", "size")))
        .size(memo, group.shapes[first])
        .const(memo.get(("field", "chunks")) + b"](")
    )
    chunk = (
        _Columns()
        .const(memo.get("chunk") + b")\x81}(" + memo.get(("field", "offsets")))
        .size(memo, group.offsets)
        .const(memo.get(("field", "sizes")))
        .size(memo, group.sizes)
        .const(b"ub")
    )
    headers, chunks = header.fill(len(first)), chunk.fill(group.n)
    width_h, width_c = len(headers) // max(len(first), 1), len(chunks) // max(group.n, 1)
    pieces: list[bytes | memoryview] = []
    for k, (a, b) in enumerate(zip(group.starts.tolist(), group.stops.tolist())):
        pieces += [headers[k * width_h : (k + 1) * width_h], chunks[a * width_c : b * width_c], b"eub"]
    return pieces


def _storage(group: _Group, memo: _Memo) -> memoryview:
    """``MetadataIndex -> _StorageInfo`` of every item of the group."""
    record = (
        _Columns()
        .const(memo.get("index") + b")\x81}(" + memo.get(("field", "fqn")))
        .memo_column(group.key)
        .const(memo.get(("field", "index")))
        .int_column(group.position)
        .const(memo.get(("field", "offset")))
        .size(memo, group.offsets)
        .const(b"ub" + memo.get("info") + b")\x81}(" + memo.get(("field", "relative_path")))
        .memo_column(group.file)
        .const(memo.get(("field", "offset")))
        .int_column(group.place[:, 0])
        .const(memo.get(("field", "length")))
        .int_column(group.place[:, 1])
        .const(b"ub")
    )
    return record.fill(group.n)
