"""A load's plan from the stored chunks and every rank's boxes; each rank receives only its own part.

Today each planner of a load split by key (:mod:`~shardpoint.formats.split_plan`) runs
:func:`plan` on its keys' rows of the index; a checkpoint whose index is one file (or that
has only ``.metadata``) is planned whole on rank 0, as described here.

``.metadata`` lists every stored chunk of every tensor: it grows with the ranks that
saved (204 MB at 4096 ranks × 300 tensors). Given to every rank, the whole file reaches
every rank of the load, which needs only the few hundred chunks its own targets
overlap, and every rank plans every rank's shared reads. Here instead:

1. rank 0 reads and checks the chunk index (:func:`~shardpoint.formats.chunk_index.share_outline`:
   arrays, nothing unpickled) or, for a checkpoint without one, ``.metadata``
   (:func:`~shardpoint.formats.dcp_metadata.share_outline`), and broadcasts its *outline*:
   every tensor's name, size and dtype, without chunks or where they are stored, a few
   hundred bytes per tensor however many ranks saved it;
2. each rank places its targets against the outline, as it would against the file, and
   sends rank 0 their boxes (:func:`boxes_of`) in the load's plan round;
3. rank 0 finds the stored chunks each box overlaps, tensor by tensor over all ranks'
   boxes at once (numpy), plans the shared reads (:mod:`~shardpoint.formats.read_plan`)
   and sends each rank its :class:`Part`: those chunks, where they are stored, and its
   share of the reading and passing on;
4. each rank rebuilds a ``Metadata`` of just those chunks (:meth:`Part.metadata`) and
   runs DCP's planner and reader on it as it would on the whole file.

Planned on rank 0, it holds the whole index and every rank's boxes; the others hold their part. Stored
chunks are named by their *position*: the saved keys in sorted order, each key's chunks
in ``.metadata``'s order (the index's rows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from shardpoint.catalog.metadata import CheckpointMetadata, FileRecord
from shardpoint.errors import CorruptCheckpointError, TopologyMismatchError
from shardpoint.formats import chunk_index, dcp_metadata, read_plan
from shardpoint.formats.base import FormatContext, size_difference, unexpected_keys, wanted_keys
from shardpoint.formats.chunk_index import INDEX_NAME, ChunkIndex, padded, tensor_of
from shardpoint.formats.chunk_rows import ROWS_NAME
from shardpoint.formats.shared_reads import Assignment
from shardpoint.parallel import comm
from shardpoint.state.sharding import Shard
from shardpoint.state.train_state import FlatState

__all__ = [
    "Part",
    "Request",
    "boxes_of",
    "check_metadata_beside_index",
    "check_shapes",
    "plan",
    "share_outline",
    "stores_any",
    "width",
]

#: (box, chunk) pairs tested at once for overlap; bounds rank 0's memory on a layout with wide bands
_PAIRS_AT_ONCE = 1 << 22
#: a tensor stored in at most this many chunks has each box tested against all of them (:func:`_overlaps`)
_FEW_CHUNKS = 8


def share_outline(reader: Any, listed: Mapping[str, FileRecord]) -> tuple[Metadata, ChunkIndex | Metadata | None]:
    """Collective: the outline on every rank and, on rank 0, every stored chunk (see the module docstring).

    From the chunk index when the marker lists one (nothing unpickled), else from
    ``.metadata`` (older checkpoints, and those ``dcp.save`` wrote without shardpoint).
    """
    if INDEX_NAME in listed:
        return chunk_index.share_outline(reader, listed)
    return dcp_metadata.share_outline(reader)


def stores_any(chunks: ChunkIndex | Metadata) -> bool:
    """Some item has stored data (else there is no reading to share)."""
    return bool(len(chunks.file) if isinstance(chunks, ChunkIndex) else chunks.storage_data)


def check_metadata_beside_index(reader: Any, listed: Mapping[str, FileRecord]) -> set[str]:
    """Every rank, in the read round: the files of the plan's source it checked (the pipeline's ``checked``).

    A load planned from the index does not read ``.metadata``; a damaged one must still
    fail the load (plain ``dcp.load`` reads it), so the last rank reads and checks it
    while the others read their data, rather than a round of its own after the load.
    The index's files listed are returned too: rank 0 checked the index, or its head, and
    each planner of a split plan its keys' rows (:mod:`~shardpoint.formats.split_plan`).
    """
    if INDEX_NAME not in listed or reader.metadata_record is None:
        return set()
    if comm.rank() == comm.world_size() - 1:
        reader.read_metadata_bytes()  # size and checksum against the marker; raises naming .metadata
    return {INDEX_NAME, ROWS_NAME} & set(listed)


def width(outline: Metadata) -> int:
    """The dimensions every box is padded to (offset 0, size 1), so all boxes fit one array."""
    dims = [len(md.size) for md in outline.state_dict_metadata.values() if isinstance(md, TensorStorageMetadata)]
    return max([1, *dims])


@dataclass
class Request:
    """What one rank sends rank 0 in the load's plan round."""

    keys: tuple[bytes, list[str]]  # base.wanted_summary of its targets
    ids: bytes  # int32: each target's key, by its index in the sorted saved keys
    usable: bytes  # bool: the target can take a stored chunk whole (same dtype, contiguous)
    boxes: bytes  # int64 (targets, 2, width): global offset, then size
    types: tuple[str, ...]  # shared_reads.device_types of its targets


def boxes_of(present: Mapping[str, Shard], outline: Metadata, saved: Sequence[str]) -> tuple[bytes, bytes, bytes]:
    """The ``ids``, ``usable`` and ``boxes`` of a :class:`Request`, for this rank's targets that were saved.

    Columns by comprehensions, no numpy store per target (10,000 targets on a rank of small tensors).
    """
    at = {key: i for i, key in enumerate(saved)}
    tensors = outline.state_dict_metadata
    shards, dtypes = list(present.values()), [tensor_of(tensors[key], key).properties.dtype for key in present]
    ids = np.fromiter(map(at.__getitem__, present), np.int32, len(present))
    usable = [s.tensor.dtype == dtype and s.tensor.is_contiguous() for s, dtype in zip(shards, dtypes)]
    offsets, shapes = [s.global_offset for s in shards], [s.tensor.shape for s in shards]
    dims = np.fromiter(map(len, shapes), np.int64, len(shapes))
    boxes = np.stack((padded(offsets, dims, width(outline), 0), padded(shapes, dims, width(outline), 1)), axis=1)
    return ids.tobytes(), np.array(usable, np.bool_).tobytes(), boxes.tobytes()


@dataclass
class Part:
    """One rank's part of a load: the stored chunks it reads, receives or reads for others, and its role in each."""

    positions: np.ndarray  # int64, ascending
    keys: np.ndarray  # int32: index in the sorted saved keys
    starts: np.ndarray  # int64 (rows, width)
    sizes: np.ndarray  # int64 (rows, width)
    file: np.ndarray  # int32: index in ``files``
    offset: np.ndarray  # int64: where in its file
    length: np.ndarray  # int64: stored bytes
    files: list[tuple[str, tuple[str, ...] | None]]  # relative path, DCP's transform descriptors
    missing: list[str]
    unexpected: list[str]
    shared: bool = False  # replicas split the reading (formats.shared_reads)
    readers: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # the reader of each row's file
    receives: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # positions it receives
    direct: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # positions it reads, not the reader
    sends: dict[int, list[int]] = field(default_factory=dict)  # position -> the ranks it sends it to
    needed: bool = False  # some rank receives something (the same on every rank)
    kinds: tuple[str, ...] = ()  # device types of every rank's targets (shared_reads.route_for)

    def metadata(self, outline: Metadata, saved: Sequence[str]) -> tuple[Metadata, dict[MetadataIndex, int]]:
        """DCP metadata of this part's chunks alone, and each chunk's position.

        The objects DCP's planner and reader take, one set per chunk, built from lists
        (``tolist`` once per column): per-element numpy reads and ``dataclasses.replace``
        cost more than the objects (10,000 chunks on a rank of small tensors).
        """
        tensors = dict(outline.state_dict_metadata)
        keys = [saved[k] for k in self.keys.tolist()]
        dims = [len(tensor_of(tensors[key], key).size) for key in keys]
        offsets = [torch.Size(row[:n]) for row, n in zip(self.starts.tolist(), dims)]
        sizes = [torch.Size(row[:n]) for row, n in zip(self.sizes.tolist(), dims)]
        indices = list(map(MetadataIndex, keys, offsets))
        paths = [path for path, _ in self.files]
        transforms = [None if d is None else {"transform_descriptors": list(d)} for _, d in self.files]  # torch >= 2.7
        storage = {
            index: _StorageInfo(paths[f], at, n)
            if transforms[f] is None
            else _StorageInfo(paths[f], at, n, **transforms[f])
            for index, f, at, n in zip(indices, self.file.tolist(), self.offset.tolist(), self.length.tolist())
        }
        chunks: dict[str, list[ChunkStorageMetadata]] = {}
        for key, chunk in zip(keys, map(ChunkStorageMetadata, offsets, sizes)):
            chunks.setdefault(key, []).append(chunk)
        for key, listed in chunks.items():
            md = tensor_of(tensors[key], key)
            tensors[key] = TensorStorageMetadata(md.properties, md.size, listed)
        metadata = dataclasses.replace(outline, state_dict_metadata=tensors, storage_data=storage)
        return metadata, dict(zip(indices, self.positions.tolist()))

    def assignment(self, rank: int) -> Assignment:
        """This rank's share of a shared load, for :class:`~shardpoint.formats.shared_reads.Exchange`."""
        receivers = dict(self.sends)
        receivers.update({at: [rank] for at in self.receives.tolist()})
        readers = dict(zip(self.positions.tolist(), self.readers.tolist()))
        return Assignment(readers, receivers, set(self.direct.tolist()), self.needed)


@dataclass
class _Table:
    """Every stored chunk by position: its box, its size in memory and where it is stored."""

    base: np.ndarray  # (keys + 1,): the first position of each saved key
    shape: np.ndarray  # int64 (keys, dims): each key's global shape, padded with 1
    starts: np.ndarray
    sizes: np.ndarray
    nbytes: np.ndarray
    file: np.ndarray  # -1: no stored data listed for the chunk
    offset: np.ndarray
    length: np.ndarray
    files: Sequence[tuple[str, tuple[str, ...] | None]]

    @classmethod
    def of(cls, index: ChunkIndex, dims: int) -> _Table:
        """The index's columns, boxes cut to ``dims``, and each chunk's bytes in memory (numpy, no step per chunk)."""
        itemsize = [0 if d is None else _ITEMSIZE[d] for d in index.dtypes]
        counts = np.diff(index.first_row)
        starts, sizes = index.starts[:, :dims], index.sizes[:, :dims]
        nbytes = np.repeat(np.array(itemsize, np.int64), counts)
        for d in range(dims):  # a column at a time: a product over a short axis is several times slower
            nbytes *= sizes[:, d]
        shape = padded(index.shapes, np.fromiter(map(len, index.shapes), np.int64, len(index.shapes)), dims, 1)
        return cls(index.first_row, shape, starts, sizes, nbytes, index.file, index.offset, index.length, index.files)

    def key_of(self, positions: np.ndarray) -> np.ndarray:
        return (np.searchsorted(self.base, positions, side="right") - 1).astype(np.int32)


_ITEMSIZE = {str(d): d.itemsize for d in vars(torch).values() if isinstance(d, torch.dtype)}


def plan(
    chunks: ChunkIndex | Metadata,
    requests: Sequence[Request],
    shared: bool,
    budget: int | np.ndarray,
    where: str,
    dims: int | None = None,
    readers: Mapping[str, int] | None = None,
    finish: Callable[[Part], Any] | None = None,
) -> list[Any]:
    """Every rank's :class:`Part`, from the stored chunks and every rank's :class:`Request` for them.

    ``chunks``: the checkpoint's :class:`~shardpoint.formats.chunk_index.ChunkIndex` (or
    some keys of it: :mod:`~shardpoint.formats.split_plan`), or its whole ``.metadata``
    (a checkpoint without an index). ``shared``: replicas split the reading
    (:mod:`~shardpoint.formats.shared_reads`), each rank's buffers bounded by ``budget``
    bytes (one bound, or one per rank). ``readers``: each file's reader (a request's
    number), as every planner of a split plan names it
    (:func:`~shardpoint.formats.read_plan.designated_readers`), rather than balanced over
    what this plan sees. ``where``: the checkpoint, for messages.
    ``dims``: the width of the requests' boxes (:func:`width` of the whole outline), when
    ``chunks`` holds only some keys. ``finish``: applied to each rank's
    part as it is made, the result kept in its place (a planner wires each as it goes,
    rather than holding every asker's part at once).
    """
    index = chunks if isinstance(chunks, ChunkIndex) else ChunkIndex.from_metadata(chunks, where)
    world, saved = len(requests), index.keys
    dims = dims or max([1, *map(len, index.shapes)])  # width() of the outline
    table = _Table.of(index, dims)
    ranks, at, exact = _overlaps(table, requests, dims)
    unstored = at[table.file[at] < 0]
    if len(unstored):
        key = saved[int(table.key_of(unstored[:1])[0])]
        raise CorruptCheckpointError(f"{where}: .metadata lists a chunk of {key!r} with no stored data; it is damaged")
    wanted = wanted_keys((request.keys for request in requests), saved)
    missing, unexpected = sorted(wanted - set(saved)), unexpected_keys(set(saved), wanted)
    pair = ranks.astype(np.int64) * len(table.file) + at
    if not (np.diff(pair) >= 0).all():  # a load at the saved layout finds them in order already
        order = np.argsort(pair, kind="stable")
        ranks, at, exact = ranks[order], at[order], exact[order]
    bounds = np.searchsorted(ranks, np.arange(world + 1))
    if not shared:
        return [(finish or _same)(part) for part in _Columns.of(table, ranks, at).parts(bounds, missing, unexpected)]
    parts = (table, world, ranks, at, exact, bounds, requests, budget, missing, unexpected)
    return _shared_parts(*parts, readers=readers, finish=finish or _same)


def _same(part: Part) -> Part:
    return part


@dataclass
class _Columns:
    """Every (rank, chunk) pair's part columns, gathered once for all ranks; each rank's part is a slice.

    At 16,384 simulated ranks a part built rank by rank (gathers, a sort of its files)
    cost rank 0 about 1.3 s; here a rank whose pairs are distinct and come from one file
    costs a few slices, and only the others take :func:`_part`.
    """

    table: _Table
    at: np.ndarray
    keys: np.ndarray
    starts: np.ndarray
    sizes: np.ndarray
    file: np.ndarray
    offset: np.ndarray
    length: np.ndarray

    @classmethod
    def of(cls, table: _Table, ranks: np.ndarray, at: np.ndarray) -> _Columns:
        """``at``: the chunk of each pair, sorted by rank (``ranks``), then position."""
        columns = (table.key_of(at), table.starts[at], table.sizes[at], table.file[at])
        return cls(table, at, *columns, table.offset[at], table.length[at])

    def parts(self, bounds: np.ndarray, missing: list[str], unexpected: list[str]) -> Iterator[Part]:
        """Each rank's :class:`Part` of its pairs, ``bounds[r]:bounds[r + 1]``."""
        lo, hi = bounds[:-1], bounds[1:]
        some = hi > lo
        one_file = np.zeros(len(lo), np.bool_)
        if len(self.file):
            first, last = lo[some], hi[some] - 1
            same = np.minimum.reduceat(self.file, first) == np.maximum.reduceat(self.file, first)
            repeated = np.cumsum(np.concatenate(([False], self.at[1:] == self.at[:-1])))  # pairs sorted per rank
            one_file[some] = same & (repeated[last] == repeated[first])
        files, zeros, none = self.table.files, np.zeros(len(self.at), np.int32), np.zeros(0, np.int64)
        first_file = self.file[np.minimum(lo, max(len(self.file) - 1, 0))].tolist() if len(self.file) else []
        for r, (a, b, simple) in enumerate(zip(lo.tolist(), hi.tolist(), one_file.tolist())):
            if not simple:
                yield _part(self.table, read_plan.distinct(self.at[a:b]), missing, unexpected)
                continue
            columns = (self.at[a:b], self.keys[a:b], self.starts[a:b], self.sizes[a:b], zeros[a:b])
            where = (self.offset[a:b], self.length[a:b], [files[first_file[r]]])
            yield Part(*columns, *where, missing, unexpected, readers=zeros[:0], receives=none, direct=none)


def _shared_parts(
    table: _Table,
    world: int,
    ranks: np.ndarray,
    at: np.ndarray,
    exact: np.ndarray,
    bounds: np.ndarray,
    requests: Sequence[Request],
    budget: int | np.ndarray,
    missing: list[str],
    unexpected: list[str],
    readers: Mapping[str, int] | None = None,
    finish: Callable[[Part], Any] = _same,
) -> list[Any]:
    needs = read_plan.Needs.from_columns(world, ranks, at, table.length[at], exact)
    paths = [path for path, _ in table.files]
    files = read_plan.Files(table.file, paths)  # no string per chunk (1.2 million at 4096 ranks)
    readers = read_plan.plan_reads(needs, files) if readers is None else readers
    receivers = read_plan.plan_sharing(needs, files, table.nbytes, budget, readers)
    reader_of_file = np.array([readers.get(path, -1) for path in paths] or [-1], np.int64)
    pairs = [position * world + rank for position, taken in receivers.items() for rank in taken]
    receiving = np.isin(at * world + ranks, np.array(pairs, np.int64))
    reader = reader_of_file[table.file[at]]
    sends: list[dict[int, list[int]]] = [{} for _ in range(world)]
    for position, taken in receivers.items():
        if taken:
            sends[int(reader_of_file[table.file[position]])][position] = taken
    kinds = tuple(sorted(set().union(*(request.types for request in requests))))
    needed = any(receivers.values())
    direct = ~receiving & (reader != ranks)
    any_receiving, any_direct = bool(receiving.any()), bool(direct.any())
    plain = _Columns.of(table, ranks, at).parts(bounds, missing, unexpected)  # each rank's own pairs
    readers32 = reader.astype(np.int32)
    none = np.zeros(0, np.int64)
    parts = []
    for r, part in enumerate(plain):
        mine = slice(bounds[r], bounds[r + 1])
        if sends[r]:  # with the chunks it reads for others
            sent = np.fromiter(sends[r], np.int64, len(sends[r]))
            positions = read_plan.distinct(np.sort(np.concatenate((at[mine], sent))))
            part = _part(table, positions, missing, unexpected)
            part.readers = reader_of_file[table.file[positions]].astype(np.int32)
        elif len(part.positions) == mine.stop - mine.start:  # its pairs as they are
            part.readers = readers32[mine]
        else:
            part.readers = reader_of_file[table.file[part.positions]].astype(np.int32)
        part.shared, part.needed, part.kinds, part.sends = True, needed, kinds, sends[r]
        part.receives = at[mine][receiving[mine]] if any_receiving else none
        part.direct = at[mine][direct[mine]] if any_direct else none
        parts.append(finish(part))
    return parts


def _part(table: _Table, positions: np.ndarray, missing: list[str], unexpected: list[str]) -> Part:
    stored = table.file[positions]
    used = read_plan.distinct(np.sort(stored))
    file = np.searchsorted(used, stored)
    return Part(
        positions=positions,
        keys=table.key_of(positions),
        starts=table.starts[positions],
        sizes=table.sizes[positions],
        file=file.astype(np.int32).reshape(-1),
        offset=table.offset[positions],
        length=table.length[positions],
        files=[table.files[i] for i in used.tolist()],
        missing=missing,
        unexpected=unexpected,
    )


def _overlaps(table: _Table, requests: Sequence[Request], dims: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (rank, stored chunk) whose boxes overlap, and whether the chunk is exactly the rank's target.

    A box of a tensor stored in a few chunks (:data:`_FEW_CHUNKS`: a load at the layout
    it was saved at, or any tensor saved whole) is tested against each of them, every such
    box at once, with no Python step per tensor (10,000 tensors on one rank took 2 s as a
    step each). A tensor stored in many chunks (saved by many ranks) has its boxes tested
    by key against only the band of chunks that can reach them (:func:`_band_pairs`).
    """
    ids_all = np.frombuffer(b"".join([request.ids for request in requests]), np.int32)
    owner = np.repeat(np.arange(len(requests)), np.fromiter(map(len, [r.ids for r in requests]), np.int64) // 4)
    usable = np.frombuffer(b"".join([request.usable for request in requests]), np.bool_)
    boxes = np.frombuffer(b"".join([request.boxes for request in requests]), np.int64).reshape(-1, 2, dims)
    first, count = table.base[ids_all], np.diff(table.base)[ids_all]
    matched = _exact_matches(table, ids_all, boxes)
    hit = np.flatnonzero(matched >= 0)
    rest = matched < 0
    few = np.flatnonzero(rest & (count <= _FEW_CHUNKS))
    b, c = _every_pair(few, first[few], count[few], table, boxes)
    banded = [(hit, matched[hit]), (b, c)]
    many = np.flatnonzero(rest & (count > _FEW_CHUNKS))
    by_key = many[np.argsort(ids_all[many], kind="stable")]
    keys, firsts = np.unique(ids_all[by_key], return_index=True)
    for key, start, stop in zip(keys.tolist(), firsts.tolist(), [*firsts[1:].tolist(), len(by_key)]):
        chosen = by_key[start:stop]
        lo, hi = int(table.base[key]), int(table.base[key + 1])
        b, c = _band_pairs(table.starts[lo:hi], table.sizes[lo:hi], boxes[chosen, 0], boxes[chosen, 1])
        banded.append((chosen[b], lo + c))
    b, c = (np.concatenate(column) for column in zip(*banded[1:]))
    same = (table.starts[c] == boxes[b, 0]).all(1) & (table.sizes[c] == boxes[b, 1]).all(1)
    b, c, same = (
        np.concatenate((hit, b)),
        np.concatenate((matched[hit], c)),
        np.concatenate((np.ones(len(hit), np.bool_), same)),
    )
    return owner[b], c, usable[b] & same


def _exact_matches(table: _Table, ids: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """The position of the stored chunk each box equals, or -1: one sorted search for all boxes.

    A load at the layout it was saved at asks for exactly the stored chunks. A box equal
    to a chunk overlaps no other chunk of its tensor (chunks are disjoint), so its one
    pair is found by looking it up (a search over all chunks at once), not by testing it
    against a band of chunks tensor by tensor (3.4 s of rank 0's 7 s at 16,384 simulated
    ranks). Chunks are named by ``K[key] + e``, ``e`` the row-major element at which the
    chunk starts inside its tensor and ``K`` the elements of the keys before: distinct for
    disjoint chunks that hold elements. Keys with an empty chunk, and empty boxes, take
    the tests of :func:`_overlaps` instead, as do all when the job's elements pass 2**62.
    """
    found = np.full(len(ids), -1, np.int64)
    shape = np.maximum(table.shape, 1)
    if not len(ids) or not len(table.file) or shape.prod(axis=1, dtype=np.float64).sum() >= 2.0**62:
        return found
    strides = np.ones_like(shape)
    strides[:, :-1] = np.cumprod(shape[:, :0:-1], axis=1)[:, ::-1]
    before = np.concatenate(([0], np.cumsum(shape.prod(axis=1))))
    counts = np.diff(table.base)
    row_key = np.repeat(np.arange(len(counts)), counts)
    named, asked = np.repeat(before[:-1], counts), before[ids]
    for d in range(shape.shape[1]):  # a column at a time: numpy's sum over a short axis is 10x slower
        named += table.starts[:, d] * np.repeat(strides[:, d], counts)
        asked += boxes[:, 0, d] * strides[ids, d]
    empty = np.bincount(row_key, (table.sizes == 0).any(axis=1), len(counts)) > 0
    order = None if (np.diff(named) > 0).all() else np.argsort(named, kind="stable")
    ordered = named if order is None else named[order]
    by_key = np.argsort(ids, kind="stable")  # a radix sort: the search then walks the chunks in order
    at = np.empty(len(ids), np.int64)
    at[by_key] = np.minimum(np.searchsorted(ordered, asked[by_key]), len(ordered) - 1)
    at = at if order is None else order[at]
    same = (named[at] == asked) & (row_key[at] == ids) & ~empty[ids]
    for d in range(shape.shape[1]):
        same &= (boxes[:, 1, d] > 0) & (table.sizes[at, d] == boxes[:, 1, d]) & (table.starts[at, d] == boxes[:, 0, d])
    found[same] = at[same]
    return found


def _every_pair(
    chosen: np.ndarray, first: np.ndarray, count: np.ndarray, table: _Table, boxes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(box, chunk position) pairs that overlap: each ``chosen`` box against every chunk of its tensor.

    ``first``, ``count``: where each chosen box's tensor's chunks begin, and how many.
    """
    found_b, found_c = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    total = np.cumsum(count)
    begin = 0
    while begin < len(chosen):  # at most _PAIRS_AT_ONCE pairs held at once
        end = max(int(np.searchsorted(total, total[begin] - count[begin] + _PAIRS_AT_ONCE, side="right")), begin + 1)
        n = count[begin:end]
        b = np.repeat(chosen[begin:end], n)
        c = np.repeat(first[begin:end] - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))
        ends, box_ends = table.starts[c] + table.sizes[c], boxes[b, 0] + boxes[b, 1]
        hit = (table.starts[c] < box_ends).all(1) & (ends > boxes[b, 0]).all(1)
        found_b.append(b[hit])
        found_c.append(c[hit])
        begin = end
    return np.concatenate(found_b), np.concatenate(found_c)


def _band_pairs(
    starts: np.ndarray, sizes: np.ndarray, box_starts: np.ndarray, box_sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(box, chunk) index pairs that overlap: chunks of one tensor (disjoint) against boxes of it."""
    if not len(starts) or not len(box_starts):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    ends, box_ends = starts + sizes, box_starts + box_sizes
    d = int(np.argmax((np.diff(np.sort(starts, axis=0), axis=0) != 0).sum(axis=0)))  # the most distinct starts
    order = np.argsort(starts[:, d], kind="stable")
    along = starts[order, d]
    reach = int(sizes[:, d].max())  # a chunk starting at or before box_start - reach ends before the box
    lo = np.searchsorted(along, box_starts[:, d] - reach, side="right")
    hi = np.searchsorted(along, box_ends[:, d], side="left")
    counts = np.maximum(hi - lo, 0)
    pairs_b, pairs_c = [], []
    begin = 0
    cumulative = np.cumsum(counts)
    while begin < len(counts):
        end = int(np.searchsorted(cumulative, cumulative[begin] - counts[begin] + _PAIRS_AT_ONCE, side="right"))
        end = max(end, begin + 1)
        n = counts[begin:end]
        b = np.repeat(np.arange(begin, end), n)
        within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        c = order[np.repeat(lo[begin:end], n) + within]
        hit = (starts[c] < box_ends[b]).all(1) & (ends[c] > box_starts[b]).all(1)
        pairs_b.append(b[hit])
        pairs_c.append(c[hit])
        begin = end
    return np.concatenate(pairs_b), np.concatenate(pairs_c)


def check_shapes(
    shards: dict[str, Shard], metadata: Metadata, meta: CheckpointMetadata, ctx: FormatContext, flat: FlatState
) -> None:
    """Refuse a size difference, or retarget a whole model tensor to its saved size (``FlatState.resize``)."""
    current: dict[int, str] = {}
    for key, shard in shards.items():
        md = metadata.state_dict_metadata.get(key)
        if md is None:
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise CorruptCheckpointError(f"{ctx.directory}: {key!r} is stored as an object, not a tensor")
        saved = tuple(md.size)
        if saved != shard.global_shape:
            what = f"tensor {key!r} has global shape {saved} in {ctx.directory} but {shard.global_shape} here"
            if meta.topology == ctx.topology.describe():
                current = current or {id(s): k for k, s in flat.tensors.items()}
                resized = flat.resize(current.get(id(shard), key), saved)
                if resized is None:
                    raise size_difference(what)
                shards[key] = resized
                continue
            raise TopologyMismatchError(
                f"{what}: the layout tp={ctx.topology.tp_size} pp={ctx.topology.pp_size} dp={ctx.topology.dp_size} "
                f"does not divide it the way the model expects; choose sizes that divide {saved}"
            )
