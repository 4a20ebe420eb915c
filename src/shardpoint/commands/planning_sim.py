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

Seconds are CPU seconds of this process (``time.process_time``): rank 0's work is one
thread, and on a shared machine CPU time is what a dedicated core would take.
"""

from __future__ import annotations

import gc
import pickle
import time
import tracemalloc
from typing import Any

import torch

from shardpoint.commands import bench_survey
from shardpoint.commands.bench_timing import peak_memory, traced_peak

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
    """Rank 0's part of a load's plan at ``world`` ranks, of the ``.metadata`` ``stream`` saved at the same ranks.

    Before: rank 0 unpickles ``.metadata`` and plans from it; today: it reads the
    checkpoint's ``.chunk_index`` (columns, no pickle) and plans from its arrays. Each
    rank receives the outline and its own part either way.
    """
    import xxhash

    from shardpoint.catalog.metadata import FileRecord
    from shardpoint.formats import chunk_index

    row: dict[str, Any] = {"ranks": world}
    with peak_memory() as memory:
        start = time.process_time()
        metadata = pickle.loads(stream)  # made by this process (simulate_planning)
        row["unpickling .metadata s (before)"] = time.process_time() - start
        seconds, parts, outline = _plan(metadata, world)
    row["load plan s (before)"] = seconds
    record = FileRecord(len(stream), xxhash.xxh3_64_hexdigest(stream))
    index = chunk_index.encode(chunk_index.ChunkIndex.from_metadata(metadata, "simulated"), record)
    _memory(row, "before", len(stream) + memory.extra, len(pickle.dumps(outline)) + _largest(parts))
    del metadata, parts
    gc.collect()
    with peak_memory() as memory:
        start = time.process_time()
        found = chunk_index.decode(index, chunk_index.INDEX_NAME, record, lambda name: 1 << 40)
        row["reading the index s (today)"] = time.process_time() - start
        seconds, parts, _ = _plan(found, world)
    row["load plan s (today)"] = seconds
    _memory(row, "today", len(index) + memory.extra, len(pickle.dumps(found.outline)) + _largest(parts))
    row[".metadata MB"], row[".chunk_index MB"] = len(stream) / 1e6, len(index) / 1e6
    row["chunks per rank"] = len(parts[-1].positions)
    del parts
    gc.collect()
    row.update(simulate_split_load(found, world))
    return row


def simulate_split_load(index: Any, world: int) -> dict[str, Any]:
    """The same load planned across ranks by rows (:mod:`shardpoint.formats.split_plan`): the slowest rank's part.

    Rank 0 decodes the head; every rank makes its asks (timed on the last); the busiest
    planner (the most rows, then the most ranks asking) reads and plans its share, fed
    exactly the asks each rank's routing sends it; a rank joins one piece per planner of
    its boxes (timed with that planner's piece standing in for each: the work is per
    piece). The slowest rank's time until reads begin is their sum. Its memory is the
    head every rank holds, and on the busiest planner the rows it read, the asks it
    received and the peak while planning.
    """
    import numpy as np

    from shardpoint.catalog.metadata import FileRecord
    from shardpoint.formats import chunk_rows, row_shares, split_plan
    from shardpoint.formats.base import wanted_summary

    record = FileRecord(1, "00")
    head_bytes, rows = chunk_rows.encode_split(index, record)

    def size_of(name: str) -> int:
        return len(rows) if name == chunk_rows.ROWS_NAME else 1 << 40

    row: dict[str, Any] = {}
    start = time.process_time()
    head = chunk_rows.decode_head(head_bytes, chunk_rows.HEAD_NAME, record, size_of)
    row["head read s (split)"] = time.process_time() - start
    saved = head.keys
    summary = wanted_summary(saved, saved)
    start = time.process_time()
    mine = split_plan.asks(_request(summary, head, world - 1, world), head, world, 1 << 30)
    asks_seconds = time.process_time() - start
    busiest = int(np.argmax(np.diff(row_shares.cut(head, np.arange(world + 1), world))))
    received = _received(head, busiest, world, summary)
    reads: list[int] = []

    def read_range(at: int, length: int) -> bytes:
        reads.append(length)
        return rows[at : at + length]

    gc.collect()
    start = time.process_time()
    pieces = split_plan.plan_keys(received, head, read_range, True, "simulated", size_of, busiest)
    planner_seconds = time.process_time() - start
    planning = traced_peak(
        lambda: split_plan.plan_keys(received, head, read_range, True, "simulated", size_of, busiest)
    )
    held = traced_peak(lambda: pickle.loads(pickle.dumps(head)))  # what every rank holds once the head is broadcast
    start = time.process_time()
    wire = [pickle.dumps(piece) for piece in pieces]
    planner_seconds += time.process_time() - start
    planners = sum(a is not None for a in mine)
    asked_bytes = sum(len(field) for a in received if a is not None for field in a[:3])
    start = time.process_time()
    sent = next(w for w in reversed(wire) if w != pickle.dumps(None))
    split_plan.join([pickle.loads(sent)] * planners + [None] * (world - planners), head)
    asks_seconds += time.process_time() - start
    row["busiest planner s (split)"], row["asks + join s (split)"] = planner_seconds, asks_seconds
    row["until reads begin s (split)"] = row["head read s (split)"] + planner_seconds + asks_seconds
    row["busiest planner rows MB (split)"] = reads[0] / 1e6
    row["busiest planner asks MB (split)"] = asked_bytes / 1e6
    row["busiest planner ranks (split)"] = sum(a is not None and bool(a[0]) for a in received)
    row["busiest planner MB (split)"] = (asked_bytes + planning) / 1e6
    row["head held MB (split)"] = held / 1e6
    row["busiest rank peak MB (split)"] = (held + asked_bytes + planning) / 1e6
    row["share of the index MB (split)"] = (len(head_bytes) + len(rows)) / world / 1e6
    row["head MB"], row["rows MB"] = len(head_bytes) / 1e6, len(rows) / 1e6
    return row


def _request(summary: Any, head: Any, rank: int, world: int) -> Any:
    """A rank's load request: its own rows of every parameter, as it saved them."""
    import numpy as np

    from shardpoint.formats import load_parts

    params = len(head.keys)
    boxes = np.zeros((params, 2, head.width), np.int64)
    boxes[:, 0, 0], boxes[:, 1] = rank * _ROWS, (_ROWS, _COLUMNS)
    ids, usable = np.arange(params, dtype=np.int32), np.ones(params, np.bool_)
    return load_parts.Request(summary, ids.tobytes(), usable.tobytes(), boxes.tobytes(), ("cuda",))


def _received(head: Any, planner: int, world: int, summary: Any) -> list:
    """What ``planner`` hears: each rank's asks of it, routed as :func:`split_plan.asks` routes them.

    Rank ``r``'s box of a parameter is that parameter's row ``r``; only the ranks whose
    rows fall in the planner's share ask it, so only their requests are routed (a
    request from each of 16,384 ranks would take minutes to build here).
    """
    import numpy as np

    from shardpoint.formats import row_shares, split_plan

    _, _, r0, r1 = row_shares.keys_of(head, planner, world)
    rows = np.arange(r0, r1)
    ranks = np.unique(rows - head.first_row[np.searchsorted(head.first_row, rows, side="right") - 1])
    received: list = [None] * world
    for rank in [0, *ranks.tolist()]:
        received[rank] = split_plan.asks(_request(summary, head, rank, world), head, world, 1 << 30)[planner]
    return received


def _plan(chunks: Any, world: int) -> tuple[float, list, Any]:
    """Rank 0's plan of every rank's part from ``chunks`` (a ``Metadata`` or a chunk index): seconds, parts, outline."""
    import numpy as np

    from shardpoint.formats import load_parts
    from shardpoint.formats.base import wanted_summary
    from shardpoint.formats.chunk_index import ChunkIndex
    from shardpoint.formats.dcp_metadata import outline_of

    outline = chunks.outline.metadata() if isinstance(chunks, ChunkIndex) else outline_of(chunks)
    saved = sorted(outline.state_dict_metadata)
    keys = wanted_summary(saved, saved)
    ids = np.arange(len(saved), dtype=np.int32)
    requests = []
    for rank in range(world):  # each rank's boxes: its own rows of every parameter, as it saved them
        boxes = np.zeros((len(saved), 2, load_parts.width(outline)), np.int64)
        boxes[:, 0, 0], boxes[:, 1] = rank * _ROWS, (_ROWS, _COLUMNS)
        usable = np.ones(len(saved), np.bool_)
        requests.append(load_parts.Request(keys, ids.tobytes(), usable.tobytes(), boxes.tobytes(), ("cuda",)))
    start = time.process_time()
    parts = load_parts.plan(chunks, requests, True, 1 << 30, "simulated")
    return time.process_time() - start, parts, outline


def _largest(parts: list) -> int:
    return max(len(pickle.dumps(part)) for part in parts)


def _memory(row: dict[str, Any], label: str, root: int, other: int) -> None:
    row[f"rank-0 peak MB ({label})"] = root / 1e6
    row[f"other rank KB ({label})"] = other / 1e3


def _one(world: int, params: int) -> tuple[dict[str, Any], bytes]:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from shardpoint.formats.dist_replay import fingerprint
    from shardpoint.formats.metadata_records import assemble, encode

    plans = [_local_plan(rank, world, params) for rank in range(world)]
    plans_bytes = len(pickle.dumps(plans))
    start = time.process_time()
    DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False).create_global_plan(plans)
    dcp_seconds = time.process_time() - start
    start = time.process_time()
    records = [encode(plan.items, _results(rank, plan)) for rank, plan in enumerate(plans)]
    encode_seconds = (time.process_time() - start) / world
    digest = fingerprint(plans[0], 0, world)  # every rank does this for itself, in parallel
    del plans
    gc.collect()
    records_bytes = sum(r.nbytes for r in records)
    tracemalloc.start()
    start = time.process_time()
    chunks = assemble(records)
    sp_seconds = time.process_time() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    metadata_bytes = sum(map(len, chunks))
    start = time.process_time()
    flags = [digest == digest] * world  # rank 0 checks every rank's "unchanged" flag
    replayed_seconds = time.process_time() - start
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
    row.update(bench_survey.simulate_check(world, params))
    return row, b"".join(chunks)


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
