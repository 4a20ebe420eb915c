"""Writing full tensors as a committed checkpoint in one process (see the package docstring).

The destination may be local or ``s3://bucket/prefix``; the commit protocol is the
training job's (:mod:`shardpoint.lifecycle.commit`): locally a temporary directory renamed into
place, on object storage data written in place under the final prefix and committed
by the marker, then the tracker. Local writes take the directory's writer lock;
object storage has none (see :func:`writer_lock`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from shardpoint._version import __version__
from shardpoint.catalog.layout import Layout, get_layout
from shardpoint.catalog.metadata import CheckpointMetadata, FileRecord
from shardpoint.errors import CheckpointError
from shardpoint.formats import FormatContext, get_format
from shardpoint.formats.base import write_torch_file
from shardpoint.formats.dist import COMMON_FILE, dcp_writer
from shardpoint.lifecycle import commit, tracker_owner
from shardpoint.offline._common import ProgressFn, layer_of, param_key_of, single_process, stage_by_name
from shardpoint.parallel.topology import Topology
from shardpoint.state.sharding import Shard, divide
from shardpoint.state.train_state import MODEL_PREFIX, OPTIM_PREFIX, FlatState
from shardpoint.storage.base import Storage, open_storage
from shardpoint.storage.lock import DirectoryLock

__all__ = ["write_checkpoint", "writer_lock"]

log = logging.getLogger(__name__)


def write_checkpoint(
    dst_root: str | os.PathLike[str],
    iteration: int | None,
    tensors: Mapping[str, torch.Tensor],
    common: Mapping[str, Any],
    tp: int = 1,
    pp: int = 1,
    format: str = "dist",
    layout: str = "megatron",
    split_dims: Mapping[str, int | None] | None = None,
    release: bool = False,
    config: Mapping[str, Any] | None = None,
    *,
    stages: Mapping[str, str] | None = None,
    metrics: Mapping[str, float] | None = None,
    update_tracker: bool = True,
    progress: ProgressFn | None = None,
) -> str:
    """Write full tensors as a complete, committed checkpoint in ``dst_root``; return its directory.

    Args:
        dst_root: the save directory to write into (created when missing): a local
            path or ``s3://bucket/prefix``.
        iteration: the checkpoint's iteration (ignored when ``release``).
        tensors: full tensors under global keys (``model.<key>``, ``optimizer.state...``).
        common: state shared by all ranks (``extra``, ``optimizer_param_groups``,
            ``scheduler``, ``distributed_optimizer``); ``iteration`` and ``config`` are set here.
        tp, pp: the layout of ``torch`` output (recorded for ``dist``, which any layout loads).
        format: ``"dist"`` or ``"torch"``.
        layout: ``"megatron"`` or ``"neox"`` directory names.
        split_dims: per key, the tensor-parallel dim (None or absent: replicated).
        release: write weights only into ``release/``; the tracker then says ``release``.
        config: the model config recorded in ``shardpoint.json`` (compared on load).
        stages: per key without a layer number, ``"first"``, ``"last"`` or ``"both"``
            (default: :func:`stage_by_name`).
        metrics: recorded in the marker (retention by metric reads them).
        update_tracker: point the tracker at the new checkpoint.
        progress: called as files are written and checksummed.

    Raises:
        CheckpointError: the checkpoint exists already, or this runs inside a
            multi-process job.
        TopologyMismatchError: a tensor or the layer count does not divide by tp / pp.
    """
    _require_one_process()
    get_format(format)  # a clear error for an unknown format name
    lay = get_layout(layout)
    storage = open_storage(dst_root)
    name = lay.dir_name(None if release else iteration)
    final = storage.join(storage.root, name)
    if storage.exists(final):
        raise CheckpointError(f"{final} exists already; write into another directory or remove it first")
    tensors, common = _payload(tensors, common, iteration, release, config)
    split_dims = dict(split_dims or {})
    if format == "torch":
        flats = _torch_rank_states(tensors, common, tp, pp, split_dims, dict(stages or {}))
        write = functools.partial(_write_torch, storage, flats, bool(common.get("distributed_optimizer")))
    else:
        pieces = {key: _tp_pieces(key, t, split_dims.get(key), tp) for key, t in tensors.items()}
        write = functools.partial(_write_dist, storage, tensors, pieces, common)
    start = time.perf_counter()
    if update_tracker:  # before any byte: another run's tracker (Megatron-LM's, DeepSpeed's) stays
        tracker_owner.refuse_foreign_tracker(storage, storage.root, lay)
    with writer_lock(storage):
        tmp = commit.begin(storage, storage.root, name)
        try:
            records = write(tmp, progress)
            meta = _metadata(iteration, release, format, lay, tp, pp, common, records, metrics, start)
            commit.publish(storage, tmp, final, meta)
        except BaseException:
            storage.remove(tmp)
            raise
        if update_tracker:
            commit.write_tracker(storage, storage.root, lay, None if release else iteration)
    log.info("wrote %s (%s format, tp=%d pp=%d, %d tensors)", final, format, tp, pp, len(tensors))
    return final


@contextlib.contextmanager
def writer_lock(storage: Storage) -> Iterator[None]:
    """Hold the save directory's writer lock (:mod:`shardpoint.storage.lock`) while the block runs.

    Local directories: a job saving there, or another offline writer, makes this
    raise :class:`~shardpoint.storage.lock.LockedError`. Object storage has no such lock
    (``flock`` needs a local file); the block runs unguarded and a log line says so.
    """
    if not storage.is_local:
        log.warning(
            "%s is on object storage, which has no writer lock: make sure no job saves there meanwhile",
            storage.root,
        )
        yield
        return
    lock = DirectoryLock(storage.root)
    lock.acquire()  # one writer per directory: a job saving there, or another offline writer, is refused
    try:
        yield
    finally:
        lock.release()


def _write_torch(
    storage: Storage,
    flats: list[tuple[Topology, FlatState]],
    distributed_optimizer: bool,
    tmp: str,
    progress: ProgressFn | None,
) -> dict[str, FileRecord]:
    """Each model-parallel rank's files, written by the torch format itself, with size and checksum."""
    records: dict[str, FileRecord] = {}
    fmt = get_format("torch")
    for done, (topo, flat) in enumerate(flats, 1):
        records.update(fmt.save(FormatContext(storage, tmp, topo, distributed_optimizer=distributed_optimizer), flat))
        if progress:
            progress("writing", done, len(flats))
    return records


def _write_dist(
    storage: Storage,
    tensors: Mapping[str, torch.Tensor],
    pieces: dict[str, list[Shard]],
    common: Mapping[str, Any],
    tmp: str,
    progress: ProgressFn | None,
) -> dict[str, FileRecord]:
    """The files a dist save writes: DCP's (one process, tensors as their tp pieces) and ``common.pt``.

    DCP's writer is the dist format's own (local: fsynced files; object storage:
    uploads through fsspec), which checksums each file while writing it.
    """
    writer = dcp_writer(storage, tmp)
    with single_process():
        dcp.save(dict(tensors), storage_writer=writer, planner=_PiecesSavePlanner(pieces), no_dist=True)
    records = writer.records()
    records[COMMON_FILE] = write_torch_file(dict(common), storage.join(tmp, COMMON_FILE), storage)
    if progress:
        progress("writing", 1, 1)
    return records


class _PiecesSavePlanner(DefaultSavePlanner):
    """Saves each tensor as its tensor-parallel pieces, so DCP's chunks record the split dim.

    A ``dist`` checkpoint saved by a tp=N job has N chunks per split tensor; writing the
    same chunks keeps that fact for the next conversion to ``torch`` format (a single
    whole chunk would say "replicated").
    """

    def __init__(self, pieces: dict[str, list[Shard]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan([_write_item(key, shard) for key, shards in self.pieces.items() for shard in shards])
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        offset = tuple(index.offset or ())
        tensor = next(s.tensor for s in self.pieces[index.fqn] if s.global_offset == offset)
        piece = tensor.contiguous()  # items are stored contiguous (see formats.dcp_read)
        # a view would be written with its whole storage; copy just the piece
        return piece.clone() if piece.untyped_storage().nbytes() != piece.nbytes else piece


def _write_item(key: str, shard: Shard) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(key, torch.Size(shard.global_offset)),
        type=WriteItemType.TENSOR if shard.is_full else WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(shard.global_offset), sizes=shard.tensor.shape),
            properties=TensorProperties.create_from_tensor(shard.tensor),
            size=torch.Size(shard.global_shape),
        ),
    )


def _require_one_process() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise CheckpointError(
            f"offline checkpoint writing runs in one process, but this is rank {dist.get_rank()} of "
            f"{dist.get_world_size()}; run it outside the training job (e.g. `shardpoint convert`)"
        )


def _payload(
    tensors: Mapping[str, torch.Tensor],
    common: Mapping[str, Any],
    iteration: int | None,
    release: bool,
    config: Mapping[str, Any] | None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    config = dict(config if config is not None else common.get("config", {}))
    if release:
        kept = {k: t for k, t in tensors.items() if k.startswith(MODEL_PREFIX)}
        return kept, {"iteration": 0, "extra": dict(common.get("extra", {})), "config": config}
    if iteration is None or iteration < 0:
        raise ValueError(f"iteration must be a non-negative integer for a regular checkpoint, got {iteration!r}")
    return dict(tensors), {**common, "iteration": iteration, "config": config}


def _tp_pieces(key: str, tensor: torch.Tensor, dim: int | None, tp: int) -> list[Shard]:
    return [_tp_piece(key, tensor, dim, rank, tp) for rank in range(tp if dim is not None else 1)]


def _torch_rank_states(
    tensors: Mapping[str, torch.Tensor],
    common: dict[str, Any],
    tp: int,
    pp: int,
    split_dims: dict[str, int | None],
    stages: dict[str, str],
) -> list[tuple[Topology, FlatState]]:
    """One FlatState per model-parallel rank: the keys of its stage, split for its tp rank."""
    bad = [k for k in tensors if not k.startswith((MODEL_PREFIX, OPTIM_PREFIX))]
    if bad:
        raise ValueError(f"the torch format stores model.* and optimizer.state.* keys only; got {bad[:5]}")
    placement = _stage_placement(tensors, pp, stages)
    result = []
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            shards = {
                key: _tp_piece(key, tensors[key], split_dims.get(key), tp_rank, tp)
                for key in tensors
                if pp_rank in placement[key]
            }
            topo = Topology(tp, pp, 1, rank=tp_rank + tp * pp_rank)
            result.append((topo, FlatState(shards, common, {})))
    return result


def _tp_piece(key: str, tensor: torch.Tensor, dim: int | None, tp_rank: int, tp: int) -> Shard:
    if dim is None or tp == 1:
        return Shard(tensor.contiguous(), tuple(tensor.shape), (0,) * tensor.dim())
    size = divide(tensor.shape[dim], tp, f"{key} (dim {dim})")
    offset = [0] * tensor.dim()
    offset[dim] = size * tp_rank
    return Shard(tensor.narrow(dim, size * tp_rank, size), tuple(tensor.shape), tuple(offset))


def _stage_placement(tensors: Mapping[str, torch.Tensor], pp: int, stages: Mapping[str, str]) -> dict[str, set[int]]:
    """Pipeline stages holding each key: by layer number, else the source's stage, else the naming rule."""
    layers = {k: layer_of(k) for k in tensors}
    numbers = [n for n in layers.values() if n is not None]
    if pp > 1 and not numbers:
        raise ValueError("no key has a layer number (layers.<n>.), so they cannot be split into pipeline stages")
    per_stage = divide(max(numbers) + 1, pp, "the number of layers") if numbers else 1
    by_name = {"first": {0}, "last": {pp - 1}, "both": {0, pp - 1}}
    placement = {}
    for key, number in layers.items():
        if number is not None:
            placement[key] = {number // per_stage}
            continue
        param = param_key_of(key)
        where = stages.get(key) or (stages.get(param) if param else None) or stage_by_name(param or key)
        if where not in by_name:
            raise ValueError(f"stage of {key!r} must be 'first', 'last' or 'both', got {where!r}")
        placement[key] = by_name[where]
    return placement


def _metadata(
    iteration: int | None,
    release: bool,
    format: str,
    layout: Layout,
    tp: int,
    pp: int,
    common: Mapping[str, Any],
    records: dict,
    metrics: Mapping[str, float] | None,
    start: float,
) -> CheckpointMetadata:
    extra = common.get("extra", {})
    samples, flops = extra.get("consumed_samples"), extra.get("flops")
    return CheckpointMetadata(
        iteration=0 if release else int(iteration or 0),
        format=format,
        topology={"tp": tp, "pp": pp, "dp": 1},
        release=release,
        layout=layout.name,
        config=dict(common.get("config", {})),
        files=records,
        consumed_samples=samples if isinstance(samples, int) and not isinstance(samples, bool) else None,
        flops=float(flops) if isinstance(flops, (int, float)) and not isinstance(flops, bool) else None,
        metrics={k: float(v) for k, v in (metrics or {}).items()},
        wall_time=time.time(),
        save_seconds=time.perf_counter() - start,
        library_version=__version__,
        canonical_keys=True,  # written as given: never re-mapped on load
        contiguous_items=True,  # _PiecesSavePlanner writes contiguous items
    )
