"""Reading a whole checkpoint into full-size tensors in one process (see the package docstring)."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardpoint.catalog.integrity import verify_files
from shardpoint.catalog.metadata import CheckpointMetadata, listed_record
from shardpoint.errors import CorruptCheckpointError
from shardpoint.formats.base import read_torch_file
from shardpoint.formats.dcp_errors import dcp_errors
from shardpoint.formats.dist import COMMON_FILE, ShardLoadPlanner, dcp_reader
from shardpoint.formats.torch_format import MAIN_FILE, dp_files, read_pieces
from shardpoint.offline._common import (
    Box,
    ProgressFn,
    layer_of,
    param_key_of,
    pp_rank_of,
    single_process,
    stage_by_name,
    stage_from_source,
)
from shardpoint.offline._locate import resolve
from shardpoint.state import naming
from shardpoint.state.sharding import Shard
from shardpoint.state.train_state import OPTIM_PREFIX
from shardpoint.storage.base import Storage, open_storage

__all__ = ["FullCheckpoint", "TensorInfo", "check_files", "describe_tensors", "infer_split_dims", "read_full"]

log = logging.getLogger(__name__)

_DCP_BATCHES = 20  # dcp.load calls per dist read: enough steps for a progress bar, few enough to stay fast


@dataclass
class FullCheckpoint:
    """A whole checkpoint in memory; unpacks as ``tensors, common, metadata, split_dims``.

    Attributes:
        tensors: every tensor at full size under its global key (``model.<key>``,
            ``optimizer.state.<param key>.<name>``).
        common: the state every rank shared (iteration, extra, optimizer
            hyperparameters, scheduler, config).
        metadata: the source's ``shardpoint.json``.
        split_dims: per key, the dim the saved pieces were split along (None: whole).
        stages: per key without a layer number: ``"first"``, ``"last"`` or ``"both"``
            pipeline stages (see the module docstring for the rule).
        path: the checkpoint directory read.
    """

    tensors: dict[str, torch.Tensor]
    common: dict[str, Any]
    metadata: CheckpointMetadata
    split_dims: dict[str, int | None]
    stages: dict[str, str] = field(default_factory=dict)
    path: str = ""

    def __iter__(self):
        return iter((self.tensors, self.common, self.metadata, self.split_dims))


@dataclass(frozen=True)
class TensorInfo:
    """How one tensor is stored: global shape, dtype, bytes, and the boxes saved."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    boxes: tuple[Box, ...]
    split_dims: tuple[int, ...]


# ----------------------------------------------------------------- reading


def read_full(
    path: str | os.PathLike[str],
    iteration: int | None = None,
    *,
    verify: bool = True,
    progress: ProgressFn | None = None,
    storage: Storage | None = None,
) -> FullCheckpoint:
    """Every tensor of a checkpoint at full size, with its common state and layout facts.

    Args:
        path: a checkpoint directory, or a save directory (see :func:`resolve`); local
            or ``s3://bucket/prefix``. Local files are memory-mapped; objects are
            downloaded whole, one file at a time (``dist``: the byte ranges DCP asks for).
        iteration: which checkpoint of a save directory (default: the tracker's).
        verify: check every file's size and checksum before reading.
        progress: called as files are checked and tensors read.
        storage: the storage ``path`` lives on (default: ``open_storage(path)``).

    Returns:
        A :class:`FullCheckpoint` (unpacks as ``tensors, common, metadata, split_dims``).

    Raises:
        CorruptCheckpointError: a file is missing, truncated, fails its checksum, or
            the pieces of a tensor do not cover it.

    Example:
        >>> tensors, common, meta, split_dims = read_full("runs/gpt", iteration=200)
    """
    storage = storage or open_storage(path)
    directory, meta = resolve(path, iteration, storage=storage)
    if verify:
        check_files(directory, meta, progress, storage=storage)
    reader = _read_dist if meta.format == "dist" else _read_torch
    tensors, common, boxes, stages = reader(storage, directory, meta, progress)
    names = naming.stored_to_current(tensors, where=directory, canonical=meta.canonical_keys)  # older ones
    tensors, boxes, stages = (naming.translate(names, d) for d in (tensors, boxes, stages))
    split_dims = infer_split_dims(tensors, boxes)
    return FullCheckpoint(tensors, common, meta, split_dims, stages, directory)


def check_files(
    directory: str,
    meta: CheckpointMetadata,
    progress: ProgressFn | None = None,
    *,
    storage: Storage | None = None,
) -> None:
    """Verify every recorded file, raising one error that names each bad one."""
    storage = storage or open_storage(directory)
    names = sorted(meta.files)
    problems = []
    for done, name in enumerate(names, 1):
        problems += verify_files(storage, directory, meta, [name])
        if progress:
            progress("verifying", done, len(names))
    if problems:
        raise CorruptCheckpointError(f"checkpoint {directory} is damaged: " + "; ".join(map(str, problems)))


def _read_dist(storage: Storage, directory: str, meta: CheckpointMetadata, progress: ProgressFn | None):
    metadata = dcp_reader(storage, directory, listed=meta.files).read_metadata()  # checked against the marker
    tensors: dict[str, torch.Tensor] = {}
    boxes: dict[str, set[Box]] = {}
    per_rank = sorted(k for k in metadata.state_dict_metadata if k.startswith(naming.RANK_LOCAL_PREFIX))
    if per_rank:
        log.warning(
            "%s: %d per-rank tensor(s) (e.g. Adafactor's factored statistics of sharded weights) belong to the saved "
            "layout and are not converted (load the result with strict=False to start them afresh): %s",
            directory,
            len(per_rank),
            ", ".join(per_rank[:6]),
        )
    for key, item in metadata.state_dict_metadata.items():
        if key in per_rank:
            continue
        if not isinstance(item, TensorStorageMetadata):
            log.warning(
                "%s: %r is a pickled object, not a tensor; skipped (shardpoint never unpickles those)", directory, key
            )
            continue
        tensors[key] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
        boxes[key] = {(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks}
    _check_coverage(directory, tensors, boxes)
    keys = sorted(tensors)
    step = max(1, math.ceil(len(keys) / _DCP_BATCHES))
    for start in range(0, len(keys), step):
        batch = {k: tensors[k] for k in keys[start : start + step]}
        shards = {k: Shard(t, tuple(t.shape), (0,) * t.dim()) for k, t in batch.items()}
        with single_process(), dcp_errors(directory, loading=True):
            dcp.load(
                batch,
                storage_reader=dcp_reader(
                    storage, directory, contiguous_items=meta.contiguous_items, listed=meta.files
                ),
                planner=ShardLoadPlanner(shards, directory),
                no_dist=True,
            )
        if progress:
            progress("reading", min(start + step, len(keys)), len(keys))
    listed_record(meta.files, COMMON_FILE, directory, "the dist format")  # read only what the marker lists
    common = read_torch_file(storage, storage.join(directory, COMMON_FILE))
    stages = {k: stage_by_name(k) for k in tensors if layer_of(k) is None}
    return tensors, common, boxes, stages


def _read_torch(storage: Storage, directory: str, meta: CheckpointMetadata, progress: ProgressFn | None):
    main_files = sorted(n for n in meta.files if n.endswith("/" + MAIN_FILE))
    if not main_files:
        raise CorruptCheckpointError(f"{directory} is a torch-format checkpoint listing no {MAIN_FILE} files")
    assembler = _Assembler(directory)
    held_by: dict[str, set[int]] = {}
    common: dict[str, Any] | None = None
    for done, name in enumerate(main_files, 1):
        folder = name.split("/")[0]
        payload = read_torch_file(storage, storage.join(directory, name), mmap=True)
        common = payload.get("common", {}) if common is None else common
        sharding = payload.get("sharding", {})
        stage = pp_rank_of(folder)
        for key, tensor in {**payload.get("model", {}), **payload.get("optimizer", {})}.items():
            box = sharding.get(key, {"global_shape": list(tensor.shape), "global_offset": [0] * tensor.dim()})
            assembler.place(key, tensor, box["global_offset"], box["global_shape"], split_box=True)
            held_by.setdefault(key, set()).add(stage)
        for key, items in read_pieces(storage, directory, dp_files(meta.files, folder)).items():
            for piece in items:
                assembler.place(key, piece["tensor"], piece["global_offset"], piece["global_shape"])
            held_by.setdefault(key, set()).add(stage)
        if progress:
            progress("reading", done, len(main_files))
    tensors, boxes = assembler.finish()
    pp = meta.topology["pp"]
    stages = {k: stage_from_source(k, held_by.get(k, set()), pp) for k in tensors if layer_of(k) is None}
    return tensors, common or {}, boxes, stages


class _Assembler:
    """Builds full tensors from boxes, and checks that the boxes cover each tensor."""

    def __init__(self, where: str):
        self.where = where
        self.tensors: dict[str, torch.Tensor] = {}
        self.covered: dict[str, set[Box]] = {}
        self.split_boxes: dict[str, set[Box]] = {}

    def place(
        self, key: str, tensor: torch.Tensor, offset: Iterable[int], shape: Iterable[int], split_box: bool = False
    ) -> None:
        offset, shape = tuple(int(o) for o in offset), tuple(int(s) for s in shape)
        full = self.tensors.get(key)
        if full is None:
            full = self.tensors[key] = torch.empty(shape, dtype=tensor.dtype)
        if tuple(full.shape) != shape or full.dtype != tensor.dtype:
            raise CorruptCheckpointError(
                f"{self.where}: pieces of {key!r} disagree: global shape {shape} {tensor.dtype} here, "
                f"{tuple(full.shape)} {full.dtype} elsewhere"
            )
        view = full
        for dim, (start, size) in enumerate(zip(offset, tensor.shape)):
            view = view.narrow(dim, start, size)
        view.copy_(tensor.detach())  # saved Parameters load with requires_grad; the copy must not track it
        box = (offset, tuple(tensor.shape))
        self.covered.setdefault(key, set()).add(box)
        if split_box:
            self.split_boxes.setdefault(key, set()).add(box)

    def finish(self) -> tuple[dict[str, torch.Tensor], dict[str, set[Box]]]:
        _check_coverage(self.where, self.tensors, self.covered)
        return self.tensors, {k: self.split_boxes.get(k, self.covered[k]) for k in self.tensors}


def _check_coverage(where: str, tensors: Mapping[str, torch.Tensor], boxes: Mapping[str, set[Box]]) -> None:
    for key, tensor in tensors.items():
        stored = sum(math.prod(size) for _, size in boxes.get(key, ()))
        if stored != tensor.numel():
            raise CorruptCheckpointError(
                f"{where}: the saved pieces of {key!r} hold {stored} of its {tensor.numel()} elements; "
                "the checkpoint is incomplete or its pieces overlap"
            )


def infer_split_dims(tensors: Mapping[str, torch.Tensor], boxes: Mapping[str, set[Box]]) -> dict[str, int | None]:
    """Per key, the dim along which its saved boxes differ; optimizer state follows its parameter."""
    result: dict[str, int | None] = {}
    for key in sorted(tensors, key=lambda k: k.startswith(OPTIM_PREFIX)):  # parameters first
        param = param_key_of(key)
        if param is not None and param in tensors and tensors[param].shape == tensors[key].shape:
            result[key] = result[param]
        else:
            result[key] = _differing_dim(key, boxes.get(key, set()))
    return result


def _differing_dim(key: str, boxes: set[Box]) -> int | None:
    dims = [d for d in range(len(next(iter(boxes))[0])) if len({o[d] for o, _ in boxes}) > 1] if boxes else []
    if len(dims) > 1:
        log.warning("%s is split along several dims %s; treating dim %d as its tensor-parallel dim", key, dims, dims[0])
    return dims[0] if dims else None


# ----------------------------------------------------------------- describing


def describe_tensors(directory: str, meta: CheckpointMetadata, *, storage: Storage | None = None) -> list[TensorInfo]:
    """Global shape, dtype, bytes and saved boxes of every tensor.

    ``dist`` checkpoints: from DCP's metadata alone. ``torch`` ones: from the saved
    files, memory-mapped locally (no tensor data read) but downloaded from object storage.
    """
    storage = storage or open_storage(directory)
    if meta.format == "dist":
        metadata = dcp_reader(storage, directory, listed=meta.files).read_metadata()
        found = {
            key: (tuple(item.size), item.properties.dtype, {(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks})
            for key, item in metadata.state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata)
        }
    else:
        found = _torch_boxes(storage, directory, meta)
    found = naming.translate(naming.stored_to_current(found, where=directory, canonical=meta.canonical_keys), found)
    infos = []
    for key, (shape, dtype, boxes) in sorted(found.items()):
        dims = tuple(d for d in range(len(shape)) if len({o[d] for o, _ in boxes}) > 1)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        infos.append(TensorInfo(key, shape, str(dtype).removeprefix("torch."), nbytes, tuple(sorted(boxes)), dims))
    return infos


def _torch_boxes(
    storage: Storage, directory: str, meta: CheckpointMetadata
) -> dict[str, tuple[tuple[int, ...], torch.dtype, set[Box]]]:
    found: dict[str, tuple[tuple[int, ...], torch.dtype, set[Box]]] = {}
    pieces_in = {n for n in meta.files if dp_files([n], n.split("/")[0])}
    for name in sorted(meta.files):
        path = storage.join(directory, name)
        if name.endswith("/" + MAIN_FILE):
            payload = read_torch_file(storage, path, mmap=True)
            for key, tensor in {**payload.get("model", {}), **payload.get("optimizer", {})}.items():
                box = payload.get("sharding", {}).get(key)
                shape = tuple(box["global_shape"]) if box else tuple(tensor.shape)
                offset = tuple(box["global_offset"]) if box else (0,) * tensor.dim()
                found.setdefault(key, (shape, tensor.dtype, set()))[2].add((offset, tuple(tensor.shape)))
        elif name in pieces_in:
            for key, items in read_pieces(storage, directory, [name]).items():
                for piece in items:
                    entry = found.setdefault(key, (tuple(piece["global_shape"]), piece["tensor"].dtype, set()))
                    entry[2].add((tuple(piece["global_offset"]), tuple(piece["tensor"].shape)))
    return found
