"""How the ``dist`` format writes a save: plans decided on each rank, ``.metadata`` from compact records.

``dcp.save`` plans centrally: every rank's local plan goes to rank 0, which
deduplicates the replicated boxes, validates the whole and scatters the plans back,
then gathers every item's storage record to build and pickle ``.metadata``. At 4096
ranks × 300 tensors that is tens of seconds and hundreds of MB on rank 0, at the first
save and after every change of structure. shardpoint needs none of it:

* **who writes a replicated box** is already decided on every rank, identically, from
  the boxes the save's start round gathers for the replica check
  (:attr:`~shardpoint.state.replicas.ReplicaReport.written_elsewhere`);
* **validation** is the coverage check of the same round (:mod:`shardpoint.state.coverage`):
  the boxes tile every tensor exactly once;
* **file names** are per rank (``__<rank>_<n>.distcp``, DCP's own naming).

So each rank writes its own plan with DCP's writer and sends rank 0 its
:class:`~shardpoint.formats.metadata_records.RankRecords` in the commit round the save
makes anyway; rank 0 writes ``.metadata`` from them
(:func:`~shardpoint.formats.metadata_records.assemble`), the same ``Metadata`` that
``dcp.save`` writes, read by plain ``dcp.load``, and beside it the same chunks as
arrays, which shardpoint's loads read instead: the index's head (``.chunk_index``) and
its rows (``.chunk_rows``, :mod:`~shardpoint.formats.chunk_rows`).
A save of an unchanged structure replays the cached plan (:mod:`shardpoint.formats.dist_replay`).

Saves without a replica verdict (node-local saves, which plan per node) still run
``dcp.save``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StoragePrefix  # DCP's per-rank file prefix
from torch.distributed.checkpoint.planner import SavePlan

from shardpoint.formats import chunk_index
from shardpoint.formats.base import FormatContext
from shardpoint.formats.chunk_index import INDEX_NAME
from shardpoint.formats.chunk_rows import ROWS_NAME, encode_split
from shardpoint.formats.dcp_metadata import DCP_METADATA
from shardpoint.formats.dist_replay import SavePlanCache, write_metadata, write_with_plan
from shardpoint.formats.metadata_records import RankRecords, assemble_with_index, encode
from shardpoint.parallel import comm

__all__ = ["finish", "index_after_dcp", "local_plan", "save_with_dcp", "write", "write_index"]


def write(
    ctx: FormatContext, writer: Any, planner: Any, state_dict: dict[str, Any], fingerprint: Callable[[], str | None]
) -> None:
    """Every rank: write this rank's items by the cheapest path its save allows (see the module docstring).

    ``fingerprint`` is called only by a planned save, for the cache: a replay compared it already.
    """
    rank, cache = comm.rank(), ctx.plan_cache
    if cache is not None and cache.replay:  # the same structure as the last save: no planning
        results = write_with_plan(writer, planner, state_dict, cache.plan, rank)
        if results != cache.results:
            ctx.for_coordinator = encode(cache.plan.items, results)
            cache.captured["results"] = results
        return
    if cache is None or ctx.replicas is None:
        if cache is not None:
            cache.clear()  # nothing to replay from a save planned by DCP
        save_with_dcp(ctx, writer, planner, state_dict)
        index_after_dcp(writer, ctx.directory)
        return
    plan = local_plan(planner, ctx.replicas.written_elsewhere, rank)
    results = write_with_plan(writer, planner, state_dict, plan, rank)
    ctx.for_coordinator = encode(plan.items, results)
    cache.captured.update(fingerprint=fingerprint(), plan=plan, results=results)


def save_with_dcp(ctx: FormatContext, writer: Any, planner: Any, state_dict: dict[str, Any]) -> None:
    """``dcp.save`` with its central planning, on the save's group (the control group unless an async one)."""
    dcp.save(
        state_dict,
        storage_writer=writer,
        planner=planner,
        process_group=ctx.process_group or comm.control_group(),
        no_dist=not comm.initialized(),
    )


def local_plan(planner: Any, written_elsewhere: frozenset, rank: int) -> SavePlan:
    """This rank's final plan: its boxes, less the shared ones another rank writes, in files of its own."""
    items = [
        item
        for item in planner.create_local_plan().items
        if (item.index.fqn, tuple(item.tensor_data.chunk.offsets), tuple(item.tensor_data.chunk.sizes), ())
        not in written_elsewhere
    ]
    return SavePlan(items, storage_data=_StoragePrefix(f"__{rank}_"))


def finish(ctx: FormatContext, writer: Any, parts: list[RankRecords | None]) -> bool:
    """Rank 0: write ``.metadata`` from every rank's records (None: unchanged since the cached save).

    Returns False when ``dcp.save`` wrote it already.
    """
    cache: SavePlanCache | None = ctx.plan_cache
    if cache is None or (not cache.replay and ctx.replicas is None):
        return False
    if cache.replay and all(part is None for part in parts):  # storage records as they were: the same bytes
        assert cache.metadata_chunks is not None and cache.index is not None
        write_metadata(writer, cache.metadata_chunks)
        write_index(writer, cache.index)  # it records the same .metadata
        return True
    records = [new if new is not None else old for new, old in zip(parts, cache.records or parts)]
    chunks, index = assemble_with_index(records)
    write_metadata(writer, chunks)
    files = encode_split(index, writer.records()[DCP_METADATA])
    write_index(writer, files)
    cache.captured.update(records=records, metadata_chunks=chunks, index=files)
    return True


def write_index(writer: Any, files: tuple[bytes, bytes]) -> None:
    """Write the index's head (``.chunk_index``) and rows (``.chunk_rows``), durably, through ``writer``."""
    head, rows = files
    chunk_index.write(writer, rows, ROWS_NAME)  # the rows first: a head is never on storage without its rows
    chunk_index.write(writer, head, INDEX_NAME)


def index_after_dcp(writer: Any, where: str) -> None:
    """Rank 0 of a save ``dcp.save`` planned: the index of the ``.metadata`` it wrote (``writer.metadata``).

    Built from DCP's objects (one comprehension step per chunk), as a load of a
    checkpoint without an index would; these saves (node-local ones) are not the large ones.
    """
    metadata = getattr(writer, "metadata", None)
    if metadata is None:
        return
    writer.metadata = None  # not held past the save
    record = writer.records()[DCP_METADATA]
    write_index(writer, encode_split(chunk_index.ChunkIndex.from_metadata(metadata, where), record))
