"""``shardpoint bench --simulate-ranks``: rank 0's part of a save at N ranks, simulated in one process.

Each simulated rank holds 300 ``Shard(0)`` parameters (64 × 1024 float32 rows of an
``[N·64, 1024]`` tensor), written into one file of its own. Three ways rank 0 takes
part, measured in the same run:

- **DCP's first save**: ``DefaultSavePlanner.create_global_plan`` over the N local
  plans rank 0 gathers (their pickled size is the bytes gathered; the write results
  DCP gathers after the writes come on top and are not counted);
- **shardpoint's first save** (:mod:`shardpoint.formats.dist_save`): each rank encodes
  its items (:func:`~shardpoint.formats.metadata_records.encode`, done by every rank in
  parallel: reported per rank) and rank 0 assembles ``.metadata`` from the N records
  (:func:`~shardpoint.formats.metadata_records.assemble`); the bytes gathered are the
  records' size. Rank 0's peak extra memory is the records it holds plus the peak
  ``tracemalloc`` sees while assembling (numpy reports its buffers there), against the
  size of the ``.metadata`` written;
- **a replayed save** (:mod:`shardpoint.formats.dist_replay`): N "unchanged" flags
  compared; the cached ``.metadata`` stream is written as it is.
"""

from __future__ import annotations

import gc
import pickle
import time
import tracemalloc
from typing import Any

import torch

__all__ = ["simulate_planning"]

_ROWS, _COLUMNS = 64, 1024


def simulate_planning(counts: list[int], params: int = 300) -> list[dict[str, Any]]:
    """One row per rank count: DCP's first save, shardpoint's, and a replayed one, on rank 0."""
    return [_one(world, params) for world in counts]


def _one(world: int, params: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from shardpoint.formats.dist_replay import fingerprint
    from shardpoint.formats.metadata_records import assemble, encode

    plans = [_local_plan(rank, world, params) for rank in range(world)]
    plans_bytes = len(pickle.dumps(plans))
    start = time.perf_counter()
    DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False).create_global_plan(plans)
    dcp_seconds = time.perf_counter() - start
    start = time.perf_counter()
    records = [encode(plan.items, _results(rank, plan)) for rank, plan in enumerate(plans)]
    encode_seconds = (time.perf_counter() - start) / world
    digest = fingerprint(plans[0], 0, world)  # every rank does this for itself, in parallel
    del plans
    gc.collect()
    records_bytes = sum(r.nbytes for r in records)
    tracemalloc.start()
    start = time.perf_counter()
    chunks = assemble(records)
    sp_seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    metadata_bytes = sum(map(len, chunks))
    start = time.perf_counter()
    flags = [digest == digest] * world  # rank 0 checks every rank's "unchanged" flag
    replayed_seconds = time.perf_counter() - start
    assert all(flags)
    return {
        "ranks": world,
        "first save: rank-0 planning s": sp_seconds,
        "DCP first save: rank-0 planning s": dcp_seconds,
        "planning ratio": sp_seconds / dcp_seconds,
        "gathered MB": records_bytes / 1e6,
        "DCP gathered MB": plans_bytes / 1e6,
        "gathered ratio": records_bytes / plans_bytes,
        "per-rank encode ms": encode_seconds * 1e3,
        ".metadata MB": metadata_bytes / 1e6,
        "rank-0 peak extra MB": (records_bytes + peak) / 1e6,
        "peak / .metadata": (records_bytes + peak) / metadata_bytes,
        "replayed save: rank-0 planning s": replayed_seconds,
    }


def _local_plan(rank: int, world: int, params: int) -> Any:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    properties = TensorProperties(dtype=torch.float32)
    items = []
    for p in range(params):
        offset = torch.Size([rank * _ROWS, 0])
        items.append(
            WriteItem(
                index=MetadataIndex(f"model.layers.{p}.weight", offset),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offset, sizes=torch.Size([_ROWS, _COLUMNS])),
                    properties=properties,
                    size=torch.Size([world * _ROWS, _COLUMNS]),
                ),
            )
        )
    return SavePlan(items)


def _results(rank: int, plan: Any) -> list:
    """What the writer reports: one file per rank, items one after another (4 bytes a value, a header each)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    length = _ROWS * _COLUMNS * 4 + 1024
    return [
        WriteResult(item.index, length, _StorageInfo(f"__{rank}_0.distcp", i * length, length))
        for i, item in enumerate(plan.items)
    ]
