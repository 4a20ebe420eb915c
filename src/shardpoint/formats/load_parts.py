"""A load's plan, made once on rank 0 from the whole ``.metadata``; each rank receives only its own part.

``.metadata`` lists every stored chunk of every tensor: it grows with the ranks that
saved (204 MB at 4096 ranks × 300 tensors). Given to every rank, the whole file reaches
every rank of the load, which needs only the few hundred chunks its own targets
overlap, and every rank plans every rank's shared reads. Here instead:

1. rank 0 reads and checks ``.metadata`` and broadcasts its *outline*
   (:func:`~shardpoint.formats.dcp_metadata.share_outline`):
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

Rank 0 holds the whole file and every rank's boxes (it held them before too: it read the
file); the others hold their part. Stored chunks are named by their *position*: the
saved keys in sorted order, each key's chunks in ``.metadata``'s order.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from shardpoint.errors import CorruptCheckpointError
from shardpoint.formats import read_plan
from shardpoint.formats.base import unexpected_keys, wanted_keys
from shardpoint.formats.shared_reads import Assignment
from shardpoint.state.sharding import Shard

__all__ = ["Part", "Request", "boxes_of", "plan", "width"]

#: (box, chunk) pairs tested at once for overlap; bounds rank 0's memory on a layout with wide bands
_PAIRS_AT_ONCE = 1 << 22


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
    """The ``ids``, ``usable`` and ``boxes`` of a :class:`Request`, for this rank's targets that were saved."""
    at = {key: i for i, key in enumerate(saved)}
    count, dims = len(present), width(outline)
    ids, usable = np.empty(count, np.int32), np.empty(count, np.bool_)
    boxes = np.zeros((count, 2, dims), np.int64)
    boxes[:, 1, :] = 1
    for i, (key, shard) in enumerate(present.items()):
        tensor, md = shard.tensor, outline.state_dict_metadata[key]
        ids[i] = at[key]
        usable[i] = tensor.dtype == md.properties.dtype and tensor.is_contiguous()
        boxes[i, 0, : len(shard.global_offset)] = shard.global_offset
        boxes[i, 1, : tensor.dim()] = tensor.shape
    return ids.tobytes(), usable.tobytes(), boxes.tobytes()


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
        """DCP metadata of this part's chunks alone, and each chunk's position."""
        chunks: dict[str, list[ChunkStorageMetadata]] = {}
        storage, position = {}, {}
        for row, at in enumerate(self.positions.tolist()):
            key = saved[int(self.keys[row])]
            dims = len(outline.state_dict_metadata[key].size)
            offsets = torch.Size(self.starts[row, :dims].tolist())
            chunks.setdefault(key, []).append(
                ChunkStorageMetadata(offsets, torch.Size(self.sizes[row, :dims].tolist()))
            )
            index = MetadataIndex(key, offsets)
            path, descriptors = self.files[int(self.file[row])]
            info = _StorageInfo(path, int(self.offset[row]), int(self.length[row]))
            if descriptors is not None:  # DCP's per-item transforms (torch >= 2.7)
                info = dataclasses.replace(info, transform_descriptors=list(descriptors))
            storage[index] = info
            position[index] = at
        tensors = dict(outline.state_dict_metadata)
        for key, listed in chunks.items():
            tensors[key] = dataclasses.replace(tensors[key], chunks=listed)
        return dataclasses.replace(outline, state_dict_metadata=tensors, storage_data=storage), position

    def assignment(self, rank: int) -> Assignment:
        """This rank's share of a shared load, for :class:`~shardpoint.formats.shared_reads.Exchange`."""
        receivers = dict(self.sends)
        receivers.update({at: [rank] for at in self.receives.tolist()})
        readers = dict(zip(self.positions.tolist(), self.readers.tolist()))
        return Assignment(readers, receivers, set(self.direct.tolist()), self.needed)


@dataclass
class _Table:
    """Every stored chunk of ``.metadata`` by position: its box, its size in memory and where it is stored."""

    base: np.ndarray  # (keys + 1,): the first position of each saved key
    starts: np.ndarray
    sizes: np.ndarray
    nbytes: np.ndarray
    file: np.ndarray  # -1: no stored data listed for the chunk
    offset: np.ndarray
    length: np.ndarray
    files: list[tuple[str, tuple[str, ...] | None]]

    @classmethod
    def of(cls, metadata: Metadata, saved: Sequence[str], dims: int) -> _Table:
        """Built with one Python step per chunk and per stored item (1.2 million of each at 4096 × 300)."""
        tensors = [metadata.state_dict_metadata[key] for key in saved]
        counts = [len(md.chunks) if isinstance(md, TensorStorageMetadata) else 0 for md in tensors]
        base = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
        total = int(base[-1])
        starts, sizes = np.zeros((total, dims), np.int64), np.ones((total, dims), np.int64)
        nbytes = np.zeros(total, np.int64)
        at: dict[tuple[str, torch.Size], int] = {}  # torch.Size hashes as its tuple: no conversions
        for k, (key, md) in enumerate(zip(saved, tensors)):
            if not counts[k]:
                continue
            rows, ndim = slice(int(base[k]), int(base[k + 1])), len(md.size)
            starts[rows, :ndim] = _int_rows((chunk.offsets for chunk in md.chunks), counts[k], ndim)
            sizes[rows, :ndim] = _int_rows((chunk.sizes for chunk in md.chunks), counts[k], ndim)
            nbytes[rows] = sizes[rows].prod(axis=1) * md.properties.dtype.itemsize
            at.update(zip([(key, chunk.offsets) for chunk in md.chunks], range(rows.start, rows.stop)))
        file, offset, length = np.full(total, -1, np.int32), np.zeros(total, np.int64), np.zeros(total, np.int64)
        names: dict[Any, int] = {}  # a path, or (path, DCP's transform descriptors) where it has any
        found: list[tuple[int, int, int, int]] = []  # stored in one go below: numpy's per-element stores are slow
        for index, info in (metadata.storage_data or {}).items():
            where = at.get((index.fqn, index.offset))
            if where is None:
                continue  # a pickled object's bytes (refused when asked for), not a tensor's chunk
            descriptors = getattr(info, "transform_descriptors", None)
            name = (info.relative_path, tuple(descriptors)) if descriptors else info.relative_path
            found.append((where, names.setdefault(name, len(names)), info.offset, info.length))
        if found:
            where, file_id, at_offset, stored = np.array(found, np.int64).T
            file[where], offset[where], length[where] = file_id, at_offset, stored
        files = [name if isinstance(name, tuple) else (name, None) for name in names]
        return cls(base, starts, sizes, nbytes, file, offset, length, files)

    def key_of(self, positions: np.ndarray) -> np.ndarray:
        return (np.searchsorted(self.base, positions, side="right") - 1).astype(np.int32)


def _int_rows(values: Any, count: int, ndim: int) -> np.ndarray:
    """``count`` sequences of ``ndim`` ints as a (count, ndim) array (``np.array`` of tuples is twice as slow)."""
    return np.fromiter(itertools.chain.from_iterable(values), np.int64, count * ndim).reshape(count, ndim)


def plan(metadata: Metadata, requests: Sequence[Request], shared: bool, budget: int, where: str) -> list[Part]:
    """Rank 0: every rank's :class:`Part`, from the whole ``metadata`` and every rank's :class:`Request`.

    ``shared``: replicas split the reading (:mod:`~shardpoint.formats.shared_reads`),
    each buffer bounded by ``budget`` bytes. ``where``: the checkpoint, for messages.
    """
    world, saved = len(requests), sorted(metadata.state_dict_metadata)
    dims = width(metadata)
    table = _Table.of(metadata, saved, dims)
    ranks, at, exact = _overlaps(table, requests, dims)
    unstored = at[table.file[at] < 0]
    if len(unstored):
        key = saved[int(table.key_of(unstored[:1])[0])]
        raise CorruptCheckpointError(f"{where}: .metadata lists a chunk of {key!r} with no stored data; it is damaged")
    wanted = wanted_keys((request.keys for request in requests), saved)
    missing, unexpected = sorted(wanted - set(saved)), unexpected_keys(set(saved), wanted)
    order = np.lexsort((at, ranks))
    ranks, at, exact = ranks[order], at[order], exact[order]
    bounds = np.searchsorted(ranks, np.arange(world + 1))
    if not shared:
        return [_part(table, at[bounds[r] : bounds[r + 1]], missing, unexpected) for r in range(world)]
    return _shared_parts(table, world, ranks, at, exact, bounds, requests, budget, missing, unexpected)


def _shared_parts(
    table: _Table,
    world: int,
    ranks: np.ndarray,
    at: np.ndarray,
    exact: np.ndarray,
    bounds: np.ndarray,
    requests: Sequence[Request],
    budget: int,
    missing: list[str],
    unexpected: list[str],
) -> list[Part]:
    needs = read_plan.Needs.from_columns(world, ranks, at, table.length[at], exact)
    paths = [path for path, _ in table.files]
    files = [paths[i] if i >= 0 else "" for i in table.file.tolist()]
    readers = read_plan.plan_reads(needs, files)
    items = needs.items()
    sizes = dict(zip(items.tolist(), table.nbytes[items].tolist()))
    receivers = read_plan.plan_sharing(needs, files, sizes, budget, readers)
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
    parts = []
    for r in range(world):
        mine = slice(bounds[r], bounds[r + 1])
        sent = np.fromiter(sends[r], np.int64, len(sends[r]))
        positions = read_plan.distinct(np.sort(np.concatenate((at[mine], sent))))
        part = _part(table, positions, missing, unexpected)
        part.shared, part.needed, part.kinds, part.sends = True, needed, kinds, sends[r]
        part.readers = reader_of_file[table.file[positions]].astype(np.int32)
        part.receives = at[mine][receiving[mine]]
        part.direct = at[mine][~receiving[mine] & (reader[mine] != r)]
        parts.append(part)
    return parts


def _part(table: _Table, positions: np.ndarray, missing: list[str], unexpected: list[str]) -> Part:
    used, file = np.unique(table.file[positions], return_inverse=True)
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

    Boxes are grouped by key; within a key the chunks are sorted along the dimension
    that tells them apart best, so each box is tested only against the band of chunks
    that can reach it (a saved layout's grid row, not every chunk of the tensor).
    """
    ids = [np.frombuffer(request.ids, np.int32) for request in requests]
    owner = np.repeat(np.arange(len(requests)), [len(i) for i in ids])
    ids_all = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    usable = np.concatenate([np.frombuffer(request.usable, np.bool_) for request in requests] or [np.zeros(0, bool)])
    boxes = np.concatenate(
        [np.frombuffer(request.boxes, np.int64).reshape(-1, 2, dims) for request in requests]
        or [np.zeros((0, 2, dims), np.int64)]
    )
    by_key = np.argsort(ids_all, kind="stable")
    keys, firsts = np.unique(ids_all[by_key], return_index=True)
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for key, first, last in zip(keys.tolist(), firsts.tolist(), [*firsts[1:].tolist(), len(by_key)]):
        chosen = by_key[first:last]
        lo, hi = int(table.base[key]), int(table.base[key + 1])
        b, c = _band_pairs(table.starts[lo:hi], table.sizes[lo:hi], boxes[chosen, 0], boxes[chosen, 1])
        same = (table.starts[lo + c] == boxes[chosen[b], 0]).all(1) & (table.sizes[lo + c] == boxes[chosen[b], 1]).all(
            1
        )
        found.append((owner[chosen[b]], lo + c, usable[chosen[b]] & same))
    if not found:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.bool_)
    return tuple(np.concatenate(column) for column in zip(*found))  # type: ignore[return-value]


def _band_pairs(
    starts: np.ndarray, sizes: np.ndarray, box_starts: np.ndarray, box_sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(box, chunk) index pairs that overlap: chunks of one tensor (disjoint) against boxes of it."""
    if not len(starts) or not len(box_starts):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    ends, box_ends = starts + sizes, box_starts + box_sizes
    d = int(np.argmax([len(set(starts[:, i].tolist())) for i in range(starts.shape[1])]))
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
