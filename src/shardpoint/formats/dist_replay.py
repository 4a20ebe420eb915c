"""Saves of an unchanged structure replay the last save's DCP plan: no planning, no DCP collectives.

``dcp.save`` plans every save from scratch: every rank sends its local plan to rank 0,
rank 0 deduplicates and validates ranks × tensors items and scatters the plans back,
and after the writes rank 0 gathers every item's storage record to write
``.metadata``. At 4096 ranks that is tens of seconds on rank 0 and hundreds of MB of
plans, at *every* save, although a training job saves the same structure again and
again (Megatron-LM's ``--ckpt-assume-constant-structure`` exists for this).

A :class:`SavePlanCache` keeps, on every rank, what the last planned save decided for
it (its final local plan, which assigns each replicated box to one writer, see
:mod:`shardpoint.formats.dist_save`) and its write results; rank 0 keeps every rank's
:class:`~shardpoint.formats.metadata_records.RankRecords` and the ``.metadata`` stream
assembled from them. The next save of the same structure:

1. agrees that every rank's :func:`fingerprint` is unchanged, inside the save's
   start round (:mod:`shardpoint.lifecycle.save_pipeline`), so nothing extra is exchanged;
2. writes this rank's items with the cached plan (:func:`write_with_plan`), without a
   collective;
3. sends rank 0 its records only if its write results differ from the cached ones
   (``None`` otherwise), inside the commit round; rank 0 writes the cached
   ``.metadata`` stream again (:func:`write_metadata`), assembling it anew only with
   the changed ranks' records.

A changed structure (a new parameter, a reshaped tensor, optimizer state that
appeared, a new ``RankLocal``) changes the fingerprint of some rank, and that save
plans afresh and refills the cache. The cache is trusted only after a committed
save; a failed one empties it on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from shardpoint.formats.batched_writes import sync_stream
from shardpoint.state.sharding import Shard

__all__ = [
    "SavePlanCache",
    "fingerprint",
    "fingerprint_of",
    "item_spec",
    "shard_spec",
    "write_metadata",
    "write_with_plan",
]

_METADATA = ".metadata"


@dataclass
class SavePlanCache:
    """What the last committed full save decided, per rank (and the global metadata on rank 0).

    ``replay`` is decided collectively by the save pipeline for the save in progress;
    ``captured`` holds what a full save just produced, promoted by :meth:`commit`.
    """

    fingerprint: str | None = None
    plan: SavePlan | None = None
    results: list[WriteResult] | None = None
    records: list[Any] | None = None  # rank 0: every rank's RankRecords of the last planned save
    metadata_chunks: list[bytes | memoryview] | None = None  # rank 0: the ``.metadata`` stream assembled from them
    index: tuple[bytes, bytes] | None = None  # rank 0: the chunk index written with it (head, rows: formats.chunk_rows)
    replicas: Any = None  # the last full replica check's ReplicaReport: shared boxes, the job's size
    replay: bool = False
    captured: dict[str, Any] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return self.fingerprint is not None

    def commit(self) -> None:
        """The save committed: what it captured becomes the cache (every rank calls this at the same point)."""
        for name, value in self.captured.items():
            setattr(self, name, value)
        self.captured = {}
        self.replay = False

    def clear(self) -> None:
        """The save failed: plan the next one from scratch."""
        vars(self).update(vars(SavePlanCache()))  # every field back to its default


def fingerprint(plan: SavePlan, rank: int, world: int) -> str:
    """A digest of a rank's local save plan: which boxes of which tensors, with shape and dtype."""
    return fingerprint_of(map(item_spec, plan.items), rank, world)


def fingerprint_of(specs: Iterable[tuple], rank: int, world: int) -> str:
    """:func:`fingerprint` of the items :func:`item_spec` describes (built without a plan where that is cheaper)."""
    digest = xxhash.xxh3_128()
    digest.update(f"{rank}/{world}".encode())
    digest.update("\n".join(map(repr, specs)).encode())  # one update: at 10,000 items the calls showed
    return digest.hexdigest()


def item_spec(item: WriteItem) -> tuple:
    """What a write item says of its tensor: key, box, kind, global shape, dtype."""
    data = item.tensor_data
    return (
        item.index.fqn,
        tuple(item.index.offset or ()),
        item.type.value,
        None if data is None else (tuple(data.chunk.offsets), tuple(data.chunk.sizes), tuple(data.size)),
        None if data is None else str(data.properties.dtype),
    )


def shard_spec(key: str, shard: Shard) -> tuple:
    """:func:`item_spec` of the item DCP plans for ``shard``.

    Built from the shard itself, without the write item: a replayed save checks its
    structure through this at every save, and at 10,000 tensors the items cost more.
    """
    offset, local, full = shard.global_offset, tuple(shard.tensor.shape), shard.global_shape
    kind = _TENSOR if local == full else _SHARD
    return (key, offset, kind, (offset, local, full), _dtype_name(shard.tensor.dtype))


_SHARD, _TENSOR = WriteItemType.SHARD.value, WriteItemType.TENSOR.value


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype)


def write_with_plan(writer: Any, planner: Any, state_dict: dict[str, Any], plan: SavePlan, rank: int) -> list:
    """Write this rank's items as ``plan`` (a cached final local plan) says; no collective."""
    writer.reset()
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    planner.set_up_planner(state_dict, None, rank == 0)
    writer.prepare_local_plan(plan)  # creates the directory, as in dcp.save (the plan is only handed back)
    final = planner.finish_plan(plan)
    return list(writer.write_data(final, planner).value())


def write_metadata(writer: Any, chunks: Sequence[bytes | memoryview]) -> None:
    """What DCP's ``finish`` does with its pickle: a durable ``.metadata``, written aside, then renamed."""
    tmp = writer.fs.concat_path(writer.path, _METADATA + ".tmp")
    with writer.fs.create_stream(tmp, "wb") as stream:
        for chunk in chunks:
            stream.write(chunk)
        if getattr(writer, "sync_files", False):
            sync_stream(stream)
    final = writer.fs.concat_path(writer.path, _METADATA)
    if writer.fs.exists(final):
        writer.fs.rm_file(final)
    writer.fs.rename(tmp, final)
