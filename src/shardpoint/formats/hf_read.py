"""Loading Hugging Face weights: where each rank's bytes are, who reads them, and passing them on.

The plan (:func:`plan_reads`) is computed identically on every rank from facts every rank
has gathered: the stored tensors (from the safetensors headers) and every rank's box of
every model tensor. For each tensor, the contiguous byte span of each box in the stored
row-major tensor is known; boxes whose spans overlap are read together, once, by the rank
needing most of them (the least loaded among equals). So:

- disjoint shards (FSDP2's dim-0 pieces, column-parallel rows) are read by their owners,
  straight into the parameter when dtype and layout allow, and nothing moves;
- a tensor several ranks hold (replicas, norms under tensor parallel) or whose boxes
  interleave (row-parallel columns) is read once, and each other rank is sent exactly its
  box, raw bytes point to point on shardpoint's gloo control group.

Every stored byte is read at most once across ranks, and only bytes that some rank needs.
:mod:`shardpoint.formats.shared_reads` is not used: it gives each file one reader that
reads it whole and sends whole stored chunks, and an HF tensor is one chunk, so each
FSDP2 rank would receive whole tensors to keep half of them.

Reads go in batches of :data:`READ_BATCH` bytes (what a rank holds for others at most);
the outcome of a batch's reads is agreed before its exchange, so a damaged file fails
every rank, never hangs one.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardpoint.catalog.untrusted_json import check_json_size
from shardpoint.errors import CheckpointError, CorruptCheckpointError
from shardpoint.formats.safetensors_index import INDEX_NAME, SINGLE_NAME, RangeReader, StoredTensor, parse_index
from shardpoint.parallel import comm
from shardpoint.state.sharding import Shard
from shardpoint.storage.base import Storage, open_storage

__all__ = [
    "READ_BATCH",
    "Box",
    "Read",
    "copy_into",
    "locate",
    "plan_reads",
    "read_index",
    "reraise",
    "run_reads",
    "stored_tensors",
]

READ_BATCH = 256 << 20  # bytes read per exchange round: bounds what a rank holds for others


@dataclass(frozen=True)
class Box:
    """What one rank holds of one model tensor."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Read:
    """One contiguous span of a stored tensor, read by ``reader``, with every box it serves."""

    key: str  # model key
    tensor: StoredTensor
    lo: int  # element span [lo, hi) in the flattened stored tensor
    hi: int
    reader: int
    members: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)  # rank, offset, shape


def locate(path: str | os.PathLike[str]) -> tuple[Storage, str, str]:
    """Storage, directory and the single file's name (``model.safetensors`` unless ``path`` names a file)."""
    text = os.fspath(path).rstrip("/")
    if text.endswith(".safetensors"):
        directory, _, name = text.rpartition("/")
        storage = open_storage(directory or ".")
        return storage, storage.root, name
    storage = open_storage(text)
    return storage, storage.root, SINGLE_NAME


def read_index(reader: RangeReader, single: str) -> dict[str, str] | None:
    """The index's weight map; None when the checkpoint is one file."""
    storage, directory = reader.storage, reader.directory
    if single == SINGLE_NAME and storage.exists(reader.path(INDEX_NAME)) and not storage.exists(reader.path(single)):
        size = reader.size(INDEX_NAME)
        check_json_size(size, reader.path(INDEX_NAME), "safetensors index")
        return parse_index(reader.read_bytes(INDEX_NAME, 0, size), reader.path(INDEX_NAME))
    if storage.exists(reader.path(single)):
        return None
    present = [n for n in storage.listdir(directory) if n.endswith((".safetensors", ".json"))]
    raise CheckpointError(
        f"{directory} holds no {single} and no {INDEX_NAME} (found: {present[:8] or 'nothing'}); "
        "pass the directory of a Hugging Face model, as save_pretrained writes it"
    )


def stored_tensors(
    headers: Mapping[str, dict[str, StoredTensor]], weight_map: Mapping[str, str] | None, single: str
) -> dict[str, StoredTensor]:
    """``{stored key: StoredTensor}``: the index's keys, each found in the file the index names."""
    if weight_map is None:
        return dict(headers[single])
    stored = {}
    for key, file in weight_map.items():
        tensor = headers[file].get(key)
        if tensor is None:
            raise CorruptCheckpointError(
                f"{INDEX_NAME} places tensor {key!r} in {file}, whose header does not hold it; "
                "the index and the shards are from different saves"
            )
        stored[key] = tensor
    return stored


def plan_reads(
    pairs: Mapping[str, str], stored: Mapping[str, StoredTensor], everyone: Sequence[Mapping[str, Box]]
) -> list[Read]:
    """Every read of the load, in file order; identical on every rank (computed from gathered facts only).

    Readers are chosen biggest span first (as :func:`shardpoint.formats.shared_reads.plan_reads`
    deals out files): the rank needing most of a span reads it, the least loaded among equals.
    """
    reads = []
    for key, skey in pairs.items():
        tensor = stored[skey]
        holders: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
        for rank, boxes in enumerate(everyone):
            box = boxes.get(key)
            if box is not None and math.prod(box.shape) != 0:
                holders.setdefault((box.offset, box.shape), []).append(rank)
        for group in _overlapping(tensor.shape, holders):
            read = Read(key, tensor, group[0][0], max(hi for _, hi, _ in group), 0)
            read.members = [(rank, box[0], box[1]) for _, _, box in group for rank in holders[box]]
            reads.append(read)
    load = [0] * len(everyone)
    for read in sorted(reads, key=lambda r: (-(r.hi - r.lo) * r.tensor.dtype.itemsize, r.key, r.lo)):
        read.reader = max(read.members, key=lambda m: (math.prod(m[2]), -load[m[0]], -m[0]))[0]
        load[read.reader] += (read.hi - read.lo) * read.tensor.dtype.itemsize
    return sorted(reads, key=lambda r: (r.tensor.file, r.tensor.start, r.lo))


def _overlapping(shape: Sequence[int], boxes: Mapping[tuple, list[int]]) -> list[list[tuple[int, int, tuple]]]:
    """Boxes grouped so that the byte spans of different groups never overlap: ``[(lo, hi, box), ...]`` each."""
    spans = sorted((*_span(shape, offset, size), (offset, size)) for offset, size in boxes)
    groups: list[list[tuple[int, int, tuple]]] = []
    end = -1
    for lo, hi, box in spans:
        if groups and lo < end:
            groups[-1].append((lo, hi, box))
        else:
            groups.append([(lo, hi, box)])
        end = max(end, hi)
    return groups


def _span(shape: Sequence[int], offset: Sequence[int], size: Sequence[int]) -> tuple[int, int]:
    """The range of flat (row-major) element indices from the box's first element to its last."""
    strides = _strides(shape)
    lo = sum(o * s for o, s in zip(offset, strides))
    return lo, lo + sum((n - 1) * s for n, s in zip(size, strides)) + 1


def _strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def run_reads(reads: Sequence[Read], shards: Mapping[str, Shard], reader: RangeReader, me: int) -> None:
    """Every rank's reads, batch by batch; collective.

    A batch whose boxes all stay with their reader (FSDP2's disjoint shards) needs no
    agreement of its own: its failure is kept and raised by the one agreement at the
    end. Before an exchange every rank's reads so far must have succeeded, and its landing
    buffers must be allocated (a rank out of memory fails inside the agreement, naming
    itself), or a rank would wait for bytes that never come.
    """
    error: BaseException | None = None
    for batch in _batches(reads):
        if any(rank != read.reader for read in batch for rank, _, _ in read.members):
            sends, landing = comm.agree(
                functools.partial(_prepare_unless_failed, error, batch, shards, reader, me),
                "reading Hugging Face weights",
            )
            error = _exchange(batch, sends, landing, shards, me)
        elif error is None:
            try:
                _read_batch(batch, shards, reader, me)
            except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement below
                error = exc
    comm.agree(lambda: reraise(error), "reading Hugging Face weights")


def _batches(reads: Sequence[Read]) -> list[list[Read]]:
    """Consecutive reads of at most :data:`READ_BATCH` bytes together (a larger span alone)."""
    batches: list[list[Read]] = []
    size = 0
    for read in reads:
        nbytes = (read.hi - read.lo) * read.tensor.dtype.itemsize
        if not batches or size + nbytes > READ_BATCH:
            batches.append([])
            size = 0
        batches[-1].append(read)
        size += nbytes
    return batches


def reraise(error: BaseException | None) -> None:
    """Raise ``error`` if there is one: a failure kept through an exchange, raised inside an agreement."""
    if error is not None:
        raise error


def _read_batch(
    batch: Sequence[Read], shards: Mapping[str, Shard], reader: RangeReader, me: int
) -> dict[tuple[int, int], torch.Tensor]:
    """Read this rank's spans of ``batch``; fill its own targets; return the boxes it sends, by (read, rank)."""
    requests, buffers = [], []
    for i, read in enumerate(batch):
        if read.reader != me:
            continue
        itemsize = read.tensor.dtype.itemsize
        start = read.tensor.start + read.lo * itemsize
        mapped = reader.view(read.tensor.file, start, (read.hi - read.lo) * itemsize)
        if mapped is not None:  # mapped, not copied; a misaligned tensor (odd files only) is copied aligned
            buffers.append((i, read, mapped if start % itemsize == 0 else mapped.clone()))
            continue
        direct = _as_bytes_target(shards[read.key].tensor, read.tensor.dtype)
        if len(read.members) == 1 and direct is not None and direct.numel() == (read.hi - read.lo) * itemsize:
            requests.append((read.tensor.file, start, direct))  # the whole span is this rank's own parameter
            continue
        buffer = torch.empty((read.hi - read.lo) * itemsize, dtype=torch.uint8)
        requests.append((read.tensor.file, start, buffer))
        buffers.append((i, read, buffer))
    reader.read_into(requests)
    sends = {}
    for i, read, buffer in buffers:
        flat = buffer.view(read.tensor.dtype)
        strides = _strides(read.tensor.shape)
        for rank, offset, size in read.members:
            first = sum(o * s for o, s in zip(offset, strides)) - read.lo + flat.storage_offset()
            box = flat.as_strided(size, strides, first)
            if rank == me:
                copy_into(shards[read.key].tensor, box)
            else:
                sends[(i, rank)] = box.contiguous().reshape(-1).view(torch.uint8)
    return sends


def _prepare_unless_failed(
    error: BaseException | None, batch: Sequence[Read], shards: Mapping[str, Shard], reader: RangeReader, me: int
) -> tuple[dict[tuple[int, int], torch.Tensor], dict[int, torch.Tensor]]:
    """:func:`_prepare_exchange`, or ``error`` (an earlier batch's failure) raised inside the agreement."""
    reraise(error)
    return _prepare_exchange(batch, shards, reader, me)


def _prepare_exchange(
    batch: Sequence[Read], shards: Mapping[str, Shard], reader: RangeReader, me: int
) -> tuple[dict[tuple[int, int], torch.Tensor], dict[int, torch.Tensor]]:
    """Before an exchange: this rank's reads (the boxes it sends) and the buffers its receives land in."""
    sends = _read_batch(batch, shards, reader, me)
    landing = {}
    for i, read in enumerate(batch):
        for rank, _, size in read.members:
            if rank == me != read.reader and _as_bytes_target(shards[read.key].tensor, read.tensor.dtype) is None:
                landing[i] = torch.empty(math.prod(size) * read.tensor.dtype.itemsize, dtype=torch.uint8)
    return sends, landing


def _exchange(
    batch: Sequence[Read],
    sends: Mapping[tuple[int, int], torch.Tensor],
    landing: Mapping[int, torch.Tensor],
    shards: Mapping[str, Shard],
    me: int,
) -> BaseException | None:
    """Send each box read for another rank to it; receive this rank's (raw bytes, in the same order everywhere).

    Allocates nothing (``landing`` was allocated before the agreement); a failure to copy
    what arrived is returned, to be raised by the next agreement, so no peer is left waiting.
    """
    group = comm.control_group()
    ops, copies = [], []
    for i, read in enumerate(batch):
        for rank, _, size in read.members:
            if rank == read.reader:
                continue
            if me == read.reader:
                ops.append(dist.P2POp(dist.isend, sends[(i, rank)], rank, group))
            elif me == rank:
                target = shards[read.key].tensor
                buffer = _as_bytes_target(target, read.tensor.dtype)
                if buffer is None:
                    buffer = landing[i]
                    copies.append((target, buffer.view(read.tensor.dtype).view(size)))
                ops.append(dist.P2POp(dist.irecv, buffer, read.reader, group))
    comm.exchange(ops, "sending Hugging Face weights read for other ranks")
    try:
        for target, box in copies:
            copy_into(target, box)
    except Exception as exc:  # noqa: BLE001 - raised on every rank by the next agreement
        return exc
    return None


def _as_bytes_target(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The parameter's own bytes, to read or receive into directly, when its dtype and layout allow."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu" or tensor.dtype != dtype or not tensor.is_contiguous():
        return None
    return tensor.reshape(-1).view(torch.uint8)


def copy_into(target: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        target.copy_(value)
