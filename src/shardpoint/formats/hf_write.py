"""Saving Hugging Face weights from every rank: who writes which file, who sends which piece, the commit.

The tensors (tied ones once) are split into files as ``save_pretrained`` splits them, and
each file gets a writer rank (balanced by bytes); :class:`WritePlan` is the same on every
rank. Writers stream their files one tensor at a time (:func:`write_rounds`): in round i
every writer assembles its i-th full tensor from the pieces the other ranks send it (one
copy of each distinct box, cast to the output dtype before sending), so a rank holds at
most one full tensor beyond its own state. Pieces travel as raw bytes, point to point on
shardpoint's gloo control group.

Commit: on local storage files are written under temporary names, and once every rank
succeeded the previous index (and ``model.safetensors``) is removed, the files are
renamed into place, and the index is written last: a half-written directory never
reads as a complete model, and a failed save leaves the previous one as it was. On
object storage (no rename) the previous index is removed before writing and the new
one is the commit.

DCP's ``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)`` was
measured against this (2 gloo ranks, FSDP2, 311 MB of bf16): 2.6 s vs 1.0 s. It writes
every rank's pieces to ``sharded/`` and then rank 0 reads them all back to write the
consolidated files (twice the bytes written, a second full copy left on disk), writes
no ``config.json`` and local files only, and commits nothing atomically.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist

from shardpoint.errors import CheckpointError
from shardpoint.formats.hf_read import Box, copy_into
from shardpoint.formats.safetensors_index import (
    INDEX_NAME,
    SHARD_NAME,
    SINGLE_NAME,
    encode_header,
    file_names,
    index_json,
    plan_files,
)
from shardpoint.parallel import comm
from shardpoint.state import naming
from shardpoint.state.sharding import Shard
from shardpoint.storage.base import Storage, fsync_dir, open_storage

__all__ = [
    "FileWriter",
    "WritePlan",
    "as_dtype",
    "finish",
    "open_dir",
    "prepare",
    "unpublish",
    "write_rounds",
]

log = logging.getLogger(__name__)

_TMP = re.compile(r"^\.model.*\.safetensors\.shardpoint-tmp$")


class WritePlan:
    """Which tensors go to which file, which rank writes each file, and who sends each piece: same on every rank."""

    def __init__(self, everyone: Sequence[Mapping[str, Box]], dtype: torch.dtype | None, max_bytes: int):
        self.boxes: dict[str, Box] = {}  # first box of each key, in the lowest rank's order
        for boxes in everyone:
            for key, box in boxes.items():
                self.boxes.setdefault(key, box)
        self.dtypes = {k: _out_dtype(b.dtype, dtype) for k, b in self.boxes.items()}
        self.nbytes = {k: math.prod(b.global_shape) * self.dtypes[k].itemsize for k, b in self.boxes.items()}
        self.holders = {key: _holders(key, everyone, box.global_shape) for key, box in self.boxes.items()}
        files = plan_files(self.nbytes.items(), max_bytes)
        # wider dtypes first keeps every tensor's data aligned, as safetensors' own writer orders them
        self.files = [sorted(keys, key=lambda k: -self.dtypes[k].itemsize) for keys in files]
        self.names = file_names(len(self.files))
        self.total_size = sum(self.nbytes.values())
        load = [0] * len(everyone)
        self.writers = [0] * len(self.files)
        for index in sorted(range(len(self.files)), key=lambda i: -sum(self.nbytes[k] for k in self.files[i])):
            self.writers[index] = min(range(len(load)), key=lambda r: (load[r], r))
            load[self.writers[index]] += sum(self.nbytes[k] for k in self.files[index])
        self.sequence = [
            [
                (index, key)
                for index in range(len(self.files))
                if self.writers[index] == rank
                for key in self.files[index]
            ]
            for rank in range(len(everyone))
        ]

    def sources(self, key: str, writer: int) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """``(rank, offset, shape)`` sending each distinct box of ``key``: the writer itself when it holds it."""
        return [
            (writer if writer in ranks else ranks[0], offset, shape)
            for (offset, shape), ranks in self.holders[key].items()
        ]


def _holders(key: str, everyone: Sequence[Mapping[str, Box]], shape: tuple[int, ...]) -> dict[tuple, list[int]]:
    holders: dict[tuple, list[int]] = {}
    for rank, boxes in enumerate(everyone):
        box = boxes.get(key)
        if box is not None and math.prod(box.shape) != 0:
            holders.setdefault((box.offset, box.shape), []).append(rank)
    covered = sum(math.prod(size) for _, size in holders)
    if covered != math.prod(shape):
        raise CheckpointError(
            f"the ranks' pieces of {key!r} hold {covered} elements of its {math.prod(shape)}: they do not tile the "
            "tensor once (partial or overlapping shards), so it cannot be written as one full tensor"
        )
    return holders


class FileWriter:
    """Streams this rank's files: header first, then each tensor as it is assembled."""

    def __init__(self, storage: Storage, directory: str, plan: WritePlan, me: int, in_place: bool):
        self.storage, self.directory, self.plan, self.in_place = storage, directory, plan, in_place
        self.mine = [i for i, writer in enumerate(plan.writers) if writer == me]
        self.bytes_written = 0
        self._stack: ExitStack | None = None
        self._file: Any = None
        self._current = -1

    def path(self, index: int, final: bool = False) -> str:
        name = self.plan.names[index]
        return self.storage.join(self.directory, name if final or self.in_place else f".{name}.shardpoint-tmp")

    def write(self, index: int, tensor: torch.Tensor) -> None:
        if index != self._current:
            self.close()
            self._stack = ExitStack()
            self._file = self._stack.enter_context(self.storage.open_write(self.path(index)))
            self._current = index
            keys = self.plan.files[index]
            header, _ = encode_header([(k, self.plan.dtypes[k], self.plan.boxes[k].global_shape) for k in keys])
            self._write(header)
        if tensor.numel():
            self._write(tensor.reshape(-1).view(torch.uint8).numpy())

    def _write(self, data: Any) -> None:
        self._file.write(data)
        self.bytes_written += len(data)

    def close(self) -> None:
        stack, self._stack, self._file, self._current = self._stack, None, None, -1
        if stack is not None:
            stack.close()

    def discard(self) -> None:
        try:
            self.close()
        except Exception:
            log.debug("closing a failed weight file", exc_info=True)
        for index in self.mine:
            self.storage.remove(self.path(index))

    def publish(self) -> None:
        """Rename this rank's temporary files into place (local storage)."""
        for index in self.mine:
            os.replace(self.path(index), self.path(index, final=True))
        if self.mine:
            fsync_dir(self.directory)


def write_rounds(plan: WritePlan, shards: Mapping[str, Shard], writer: FileWriter, me: int) -> BaseException | None:
    """Round i: every writer assembles and writes its i-th tensor. A failure is kept, not raised: the exchange
    must go on, or the ranks sending to this one would wait forever; it is raised by the agreement after.

    Every buffer a round needs (the full tensor, landing space for pieces that arrive into a
    non-contiguous region, pieces converted for sending) is carved from one arena allocated
    before the first round, inside an agreement: a rank that cannot allocate it (out of
    memory) makes every rank raise naming it at once, instead of failing mid-exchange and
    leaving its peers in ``batch_isend_irecv`` until the control group's timeout.
    """
    arena = comm.agree(lambda: _Arena(_largest_round(plan, shards, me)), "allocating the buffers for a weights save")
    error: BaseException | None = None
    group = comm.control_group()
    for step in range(max(len(s) for s in plan.sequence)):
        ops, full, landing = [], None, []
        arena.reset()
        for rank, sequence in enumerate(plan.sequence):
            if step >= len(sequence):
                continue
            key = sequence[step][1]
            dtype = plan.dtypes[key]
            if rank == me:
                full = arena.take(plan.boxes[key].global_shape, dtype)
            for source, offset, size in plan.sources(key, rank):
                if source == me and rank != me:
                    piece, failed = _piece(shards[key].tensor, dtype, size, arena)
                    error = error or failed
                    ops.append(dist.P2POp(dist.isend, piece, rank, group))
                elif rank == me and full is not None:  # full: this rank's tensor, taken above
                    region = _region(full, offset, size)
                    if source == me:
                        copy_into(region, shards[key].tensor)
                    elif region.is_contiguous():
                        ops.append(dist.P2POp(dist.irecv, region.reshape(-1).view(torch.uint8), source, group))
                    else:
                        buffer = arena.take(size, dtype)
                        ops.append(dist.P2POp(dist.irecv, buffer.reshape(-1).view(torch.uint8), source, group))
                        landing.append((region, buffer))
        comm.exchange(ops, "assembling Hugging Face tensors")
        if full is not None and error is None:
            try:
                for region, buffer in landing:
                    copy_into(region, buffer)
                writer.write(plan.sequence[me][step][0], full)
            except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement that follows
                error = exc
    if error is None:
        try:
            writer.close()
        except Exception as exc:  # noqa: BLE001 - as above
            error = exc
    return error


class _Arena:
    """One allocation, handed out as aligned views and reused by every round (reset between rounds)."""

    _ALIGN = 64

    def __init__(self, nbytes: int):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.used = 0

    def reset(self) -> None:
        self.used = 0

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        view = self.buffer[self.used : self.used + nbytes]
        self.used += _aligned(nbytes)
        return view.view(dtype).view(tuple(shape))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _Arena._ALIGN) * _Arena._ALIGN


def _largest_round(plan: WritePlan, shards: Mapping[str, Shard], me: int) -> int:
    """The arena bytes this rank's busiest round takes: its full tensor, landing space, converted pieces."""
    largest = 0
    for step in range(max(len(s) for s in plan.sequence)):
        total = 0
        for rank, sequence in enumerate(plan.sequence):
            if step >= len(sequence):
                continue
            key = sequence[step][1]
            dtype = plan.dtypes[key]
            shape = plan.boxes[key].global_shape
            if rank == me:
                total += _aligned(math.prod(shape) * dtype.itemsize)
            meta = torch.empty(shape, dtype=dtype, device="meta")
            for source, offset, size in plan.sources(key, rank):
                sending = source == me and rank != me and _needs_conversion(shards[key].tensor, dtype)
                landing = rank == me and source != me and not _region(meta, offset, size).is_contiguous()
                if sending or landing:
                    total += _aligned(math.prod(size) * dtype.itemsize)
        largest = max(largest, total)
    return largest


def _needs_conversion(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return tensor.device.type != "cpu" or tensor.dtype != dtype or not tensor.is_contiguous()


def _piece(
    tensor: torch.Tensor, dtype: torch.dtype, size: Sequence[int], arena: _Arena
) -> tuple[torch.Tensor, Exception | None]:
    """This rank's piece as raw bytes in the output dtype (converted into the arena); zeros if that fails."""
    if not _needs_conversion(tensor, dtype):
        return tensor.detach().reshape(-1).view(torch.uint8), None
    out = arena.take(size, dtype)
    try:
        copy_into(out, tensor.detach())
        return out.reshape(-1).view(torch.uint8), None
    except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement after the rounds
        out.zero_()
        return out.reshape(-1).view(torch.uint8), exc


def _region(full: torch.Tensor, offset: Sequence[int], size: Sequence[int]) -> torch.Tensor:
    view = full
    for dim, (start, length) in enumerate(zip(offset, size)):
        view = view.narrow(dim, start, length)
    return view


def open_dir(path: str | os.PathLike[str]) -> tuple[Storage, str]:
    storage = open_storage(path)
    return storage, storage.root


def prepare(storage: Storage, directory: str, in_place: bool) -> None:
    """Make the directory; drop temporary files of an earlier failed save; in place, unpublish the old weights."""
    storage.makedirs(directory)
    for name in storage.listdir(directory):
        if _TMP.match(name):
            storage.remove(storage.join(directory, name))
    if in_place:
        unpublish(storage, directory)


def unpublish(storage: Storage, directory: str) -> None:
    """Remove the files that make a directory read as a complete model: the index, then ``model.safetensors``."""
    for name in (INDEX_NAME, SINGLE_NAME):
        path = storage.join(directory, name)
        if storage.exists(path):
            storage.remove(path)


def finish(storage: Storage, directory: str, plan: WritePlan, model: torch.nn.Module | None) -> None:
    """Rank 0, last: remove weight files of an earlier save that this one did not write, write the index, config."""
    for name in storage.listdir(directory):
        if SHARD_NAME.match(name) and name not in plan.names:  # model.safetensors went in unpublish
            storage.remove(storage.join(directory, name))
    if len(plan.names) > 1:
        weight_map = {key: name for name, keys in zip(plan.names, plan.files) for key in keys}
        storage.write_atomic(storage.join(directory, INDEX_NAME), index_json(weight_map, plan.total_size))
    if model is not None:
        _write_config(storage, directory, model)


def _write_config(storage: Storage, directory: str, model: torch.nn.Module) -> None:
    """``config.json`` (and ``generation_config.json``) of a ``transformers`` model, as ``save_pretrained`` does."""
    inner = naming.unwrap(model)
    config = getattr(inner, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return
    config = copy.deepcopy(config)
    config.architectures = [_model_class(inner).__name__]
    storage.write_atomic(storage.join(directory, "config.json"), config.to_json_string().encode("utf-8"))
    generation = getattr(inner, "generation_config", None)
    if generation is not None and hasattr(generation, "to_json_string"):
        storage.write_atomic(storage.join(directory, "generation_config.json"), generation.to_json_string().encode())


def _model_class(model: torch.nn.Module) -> type:
    """The model's own class: FSDP2 swaps it for a subclass named ``FSDP<name>``."""
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` as a floating-point torch dtype (also from "bfloat16", "bf16", ...); None stays None."""
    if dtype is None:
        return None
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    value = dtype if isinstance(dtype, torch.dtype) else getattr(torch, aliases.get(str(dtype), str(dtype)), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch dtype such as torch.bfloat16, got {dtype!r}")
    return value


def _out_dtype(dtype: torch.dtype, wanted: torch.dtype | None) -> torch.dtype:
    return wanted if wanted is not None and dtype.is_floating_point else dtype
