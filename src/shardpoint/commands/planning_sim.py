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

And rank 0's part of a load of that checkpoint at the same N ranks
(:func:`simulate_load`, :mod:`shardpoint.formats.load_parts`): from the N ranks' boxes,
every rank's part of the plan, and what each rank receives (the outline and its part)
against the whole ``.metadata`` that every rank received before.
"""

from __future__ import annotations

import gc
import pickle
import time
import tracemalloc
from typing import Any

import torch

__all__ = ["simulate_load", "simulate_planning"]

_ROWS, _COLUMNS = 64, 1024


def simulate_planning(counts: list[int], params: int = 300) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows per rank count: DCP's first save, shardpoint's and a replayed one; then a load of what was saved."""
    saves, loads = [], []
    for world in counts:
        row, metadata = _one(world, params)
        saves.append(row)
        loads.append(simulate_load(metadata, world, params))
        del metadata
        gc.collect()
    return saves, loads


def simulate_load(stream: bytes, world: int, params: int) -> dict[str, Any]:
    """Rank 0's part of a load's plan at ``world`` ranks, of the ``.metadata`` ``stream`` saved at the same ranks."""
    import numpy as np

    from shardpoint.formats import load_parts
    from shardpoint.formats.base import wanted_summary
    from shardpoint.formats.dcp_metadata import outline_of

    start = time.perf_counter()
    metadata = pickle.loads(stream)  # made by this process (simulate_planning)
    unpickle = time.perf_counter() - start
    outline = outline_of(metadata)
    saved = sorted(outline.state_dict_metadata)
    keys = wanted_summary(saved, saved)
    ids = np.arange(len(saved), dtype=np.int32)
    requests = []
    for rank in range(world):  # each rank's boxes: its own rows of every parameter, as it saved them
        boxes = np.zeros((len(saved), 2, load_parts.width(outline)), np.int64)
        boxes[:, 0, 0], boxes[:, 1] = rank * _ROWS, (_ROWS, _COLUMNS)
        usable = np.ones(len(saved), np.bool_)
        requests.append(load_parts.Request(keys, ids.tobytes(), usable.tobytes(), boxes.tobytes(), ("cuda",)))
    gathered = sum(len(pickle.dumps(request)) for request in requests)
    start = time.perf_counter()
    parts = load_parts.plan(metadata, requests, True, 1 << 30, "simulated")
    seconds = time.perf_counter() - start
    received = len(pickle.dumps(outline)) + max(len(pickle.dumps(part)) for part in parts)
    start = time.perf_counter()
    parts[-1].metadata(outline, saved)
    rebuild = time.perf_counter() - start
    return {
        "ranks": world,
        "load: rank-0 plan s": seconds,
        "unpickling .metadata s (rank 0; before: every rank)": unpickle,
        "gathered MB": gathered / 1e6,
        "received per rank KB": received / 1e3,
        "before: received per rank KB (.metadata)": len(stream) / 1e3,
        "received ratio": received / len(stream),
        "per-rank rebuild ms": rebuild * 1e3,
        "chunks per rank": len(parts[-1].positions),
    }


def _one(world: int, params: int) -> tuple[dict[str, Any], bytes]:
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
    row = {
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
    row.update(_start_round(world, params))
    return row, b"".join(chunks)


def _start_round(world: int, params: int) -> dict[str, Any]:
    """The first save's replica and coverage check on rank 0 (every rank ran it before, on all-gathered boxes)."""
    from shardpoint.state.replicas import survey

    nbytes = _ROWS * _COLUMNS * 4
    extents = [((world * _ROWS, _COLUMNS), 0)] * params
    boxes = [
        (
            [
                ((f"model.layers.{p}.weight", (r * _ROWS, 0), (_ROWS, _COLUMNS), ()), nbytes, False)
                for p in range(params)
            ],
            0,
            extents,
        )
        for r in range(world)
    ]
    start = time.perf_counter()
    parts = survey(boxes)
    seconds = time.perf_counter() - start
    return {
        "start round: rank-0 check s (before: every rank)": seconds,
        "start round: received per rank B (before: all-gathered)": f"{len(pickle.dumps(parts[-1]))} "
        f"({world * len(pickle.dumps(boxes[-1]))})",
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
